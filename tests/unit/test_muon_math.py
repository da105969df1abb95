"""CPU tests for megatron_mfsdp.optim.muon: parity with torch.optim.Muon and NS properties."""

from __future__ import annotations

import pytest
import torch

from megatron_mfsdp.optim.muon import (
    SCALE_MODES,
    MuonHyper,
    merge_qkv,
    muon_step_,
    orthogonalized,
    split_qkv,
    update_scale,
)
from megatron_mfsdp.optim.newton_schulz import NS_COEFFICIENTS, NewtonSchulz, newton_schulz, ns_coefficients_for

# torch.optim.Muon adjust_lr_fn -> our (scale_mode, extra_scale_factor)
ADJUST_MODES = {
    "match_rms_adamw": ("spectral", 0.2),
    "original": ("shape_scaling", 1.0),
}


def _hyper(coefficients="simple", dtype=torch.float32, scale_mode="spectral", extra=0.2, momentum=0.95, nesterov=False):
    return MuonHyper(momentum, nesterov, NewtonSchulz(5, coefficients, dtype, "standard"), scale_mode, extra)


def muon_orthogonalized_update(g, hyper: MuonHyper, split=None) -> torch.Tensor:
    """The orthogonalized update of ``g``, each block (the whole, or Q, K, V apart) times its scale."""
    return orthogonalized(g, split, hyper.ns, hyper.scale)


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("shape", [(48, 24), (24, 40), (32, 32)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", sorted(ADJUST_MODES))
def test_step_matches_torch_muon(shape, nesterov, adjust):
    """Several steps of muon_step_ equal torch.optim.Muon bitwise (fp32 master, bf16 NS)."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1] + 7 * nesterov + len(adjust))
    init = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    lr, wd, mom = 0.02, 0.1, 0.9

    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.Muon([ref], lr=lr, weight_decay=wd, momentum=mom, nesterov=nesterov, adjust_lr_fn=adjust)
    param, buf = init.clone(), torch.zeros(shape)
    scale_mode, extra = ADJUST_MODES[adjust]
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        hyper = _hyper("simple", torch.bfloat16, scale_mode, extra, mom, nesterov)
        muon_step_(param, g.clone(), buf, hyper, lr=lr, weight_decay=wd)
    assert not torch.equal(param, init)
    # Same op order as torch -> bitwise identical params and momentum buffers.
    assert torch.equal(param, ref.detach())
    assert torch.equal(buf, opt.state[ref]["momentum_buffer"])


def test_newton_schulz_matches_torch_reference():
    """Our NS equals torch's private _zeropower_via_newtonschulz (bf16, "simple") bitwise."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(1)
    for shape in [(64, 16), (16, 64), (33, 33)]:
        g = torch.randn(shape, generator=gen)
        ref = _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        out = newton_schulz(g, 5, "simple", torch.bfloat16)
        assert out.dtype == torch.float32 and out.shape == g.shape
        assert torch.equal(out, ref)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])
def test_newton_schulz_singular_values(ns_dtype, shape):
    """simple (Jordan's constants) lands in the known ~[0.5, 1.5] band; the per-step schedules are tighter."""
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(shape, generator=gen)
    sv_in = _singular_values(g)
    assert sv_in.max() / sv_in.min() > 3  # input far from orthogonal

    sv_j = _singular_values(newton_schulz(g, 5, "simple", ns_dtype))
    assert sv_j.min() > 0.5 and sv_j.max() < 1.5
    sv_q = _singular_values(newton_schulz(g, 5, "quintic", ns_dtype))
    # Measured bands for this input: simple ~[0.68, 1.05], quintic ~[0.976, 1.035],
    # polar_express (8 steps) ~[0.997, 1.005], polar_express_nanogpt ~[0.86, 1.14].
    assert (sv_q - 1).abs().max() < 0.05
    assert (sv_q - 1).abs().max() < (sv_j - 1).abs().max()
    sv_pe = _singular_values(newton_schulz(g, 8, "polar_express", ns_dtype))
    assert (sv_pe - 1).abs().max() < 0.01


def test_newton_schulz_transpose_path():
    """Tall input is orthogonalized via its transpose: NS(G) == NS(G^T)^T, shape preserved."""
    gen = torch.Generator().manual_seed(3)
    tall = torch.randn(80, 20, generator=gen)
    out = newton_schulz(tall, 5, "simple", torch.float32)
    assert out.shape == (80, 20)
    # Equal up to fp32 matmul rounding (memory layout differs between the two calls).
    wide = newton_schulz(tall.T.contiguous(), 5, "simple", torch.float32)
    torch.testing.assert_close(out, wide.T, rtol=0, atol=1e-5)
    assert not torch.allclose(out, tall / tall.norm(), atol=1e-2)
    # Columns (the small side) are ~orthonormal: O^T O ~ I (within the jordan band).
    gram = out.T @ out
    assert (gram.diagonal() - 1).abs().max() < 0.6
    off = gram - torch.diag(gram.diagonal())
    assert off.abs().max() < 0.2


def test_newton_schulz_rejects_non_2d():
    with pytest.raises(ValueError, match="2D"):
        newton_schulz(torch.randn(2, 3, 4))


def test_coefficient_schedules():
    """Stretching matches megatron-core's emerging_optimizers: 'repeat' cycles, 'extend' repeats the last."""
    assert ns_coefficients_for("simple", 7) == [(3.4445, -4.7750, 2.0315)] * 7
    q = NS_COEFFICIENTS["quintic"].steps
    assert ns_coefficients_for("quintic", 10) == list(q) * 2
    with pytest.raises(ValueError, match="multiple of 5"):
        ns_coefficients_for("quintic", 7)
    pe = NS_COEFFICIENTS["polar_express"].steps
    assert len(pe) == 8 and ns_coefficients_for("polar_express", 10) == list(pe) + [pe[-1]] * 2
    with pytest.raises(ValueError, match="at least 8"):
        ns_coefficients_for("polar_express", 5)
    nano = ns_coefficients_for("polar_express_nanogpt", 7)
    assert nano[5] == nano[6] == nano[4]
    # Every step is an odd polynomial with p'(0) = a > 1 (inflating small singular values).
    assert all(a > 1 for name in NS_COEFFICIENTS for a, _, _ in NS_COEFFICIENTS[name].steps)


def test_bad_coefficient_name_raises():
    with pytest.raises(ValueError, match="--muon-coefficient-type") as err:
        ns_coefficients_for("cubic", 5)
    assert "'cubic'" in str(err.value) and all(repr(k) in str(err.value) for k in NS_COEFFICIENTS)
    with pytest.raises(ValueError, match="--muon-coefficient-type"):
        newton_schulz(torch.randn(4, 4), coefficient_type="bogus")
    with pytest.raises(ValueError, match="--muon-num-ns-steps"):
        ns_coefficients_for("simple", 0)


def test_scale_modes():
    assert update_scale((64, 16), "spectral", 1.0) == pytest.approx(8.0)
    assert update_scale((16, 64), "spectral", 0.2) == pytest.approx(1.6)
    assert update_scale((64, 16), "shape_scaling", 1.0) == pytest.approx(2.0)
    assert update_scale((16, 64), "shape_scaling", 1.0) == 1.0
    assert update_scale((64, 16), "unit_rms_norm", 1.0) == pytest.approx(2.0)
    assert update_scale((16, 64), "unit_rms_norm", 3.0) == pytest.approx(1.5)
    assert SCALE_MODES == ("spectral", "shape_scaling", "unit_rms_norm")
    with pytest.raises(ValueError, match="--muon-scale-mode") as err:
        update_scale((4, 4), "rms", 1.0)
    assert all(repr(m) in str(err.value) for m in SCALE_MODES)


def test_spectral_scale_gives_rms_match():
    """spectral*0.2 on a ~orthogonal update gives RMS ~0.2 (the AdamW-matching intent)."""
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    u = muon_orthogonalized_update(g, _hyper("quintic", torch.float32, "spectral", 0.2))
    # ||O||_F^2 ~ min(m, n) = 64, so RMS(O) ~ 1/16 and 0.2 * sqrt(256) * RMS(O) ~ 0.2.
    rms = u.pow(2).mean().sqrt().item()
    assert rms == pytest.approx(0.2, rel=0.15)


def test_split_merge_qkv_roundtrip_and_layout():
    groups, q_rows, head_dim, cols = 2, 8, 4, 12
    split = (q_rows, head_dim, head_dim)
    rows = groups * sum(split)
    m = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    q, k, v = split_qkv(m, split)
    assert q.shape == (groups * q_rows, cols) and k.shape == v.shape == (groups * head_dim, cols)
    # Row layout: group g = [q (8 rows), k (4), v (4)].
    assert torch.equal(q[q_rows:], m[16:24])  # group 1 query rows
    assert torch.equal(k[:head_dim], m[8:12])  # group 0 key rows
    assert torch.equal(v[head_dim:], m[28:32])  # group 1 value rows
    assert torch.equal(merge_qkv([q, k, v], split, m.shape), m)
    r = torch.randn(rows, cols)
    assert torch.equal(merge_qkv(split_qkv(r, split), split, r.shape), r)


def test_split_qkv_rejects_bad_rows():
    with pytest.raises(ValueError, match="divisible"):
        split_qkv(torch.randn(30, 8), (8, 4, 4))
    with pytest.raises(ValueError, match="divisible"):
        merge_qkv([torch.randn(8, 4)] * 3, (8, 4, 4), (30, 4))


def test_qkv_blockwise_orthogonalization():
    groups, split, cols = 2, (16, 8, 8), 24
    rows = groups * sum(split)
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5))
    hyper = _hyper("quintic", torch.float32, "spectral", 1.0)
    whole = muon_orthogonalized_update(g, hyper)
    blocked = muon_orthogonalized_update(g, hyper, split)
    assert blocked.shape == g.shape and blocked.dtype == torch.float32
    assert not torch.allclose(whole, blocked, atol=1e-2)
    # Each block equals its own NS scaled by its own shape.
    for part, out in zip(split_qkv(g, split), split_qkv(blocked, split)):
        expect = newton_schulz(part, 5, "quintic", torch.float32) * update_scale(part.shape, "spectral", 1.0)
        assert torch.equal(out, expect)


def test_step_with_qkv_split_and_weight_decay():
    """qkv path: param = (1 - lr*wd) * p - lr * blockwise update; buffer is the EMA."""
    split, cols = (8, 4, 4), 16
    rows = 2 * sum(split)
    gen = torch.Generator().manual_seed(6)
    p0, g = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
    p, buf = p0.clone(), torch.zeros(rows, cols)
    hyper = _hyper("simple", torch.float32, "spectral", 0.2, momentum=0.9)
    muon_step_(p, g, buf, hyper, lr=0.1, weight_decay=0.5, split_rows=split)
    assert torch.allclose(buf, 0.1 * g)
    upd = muon_orthogonalized_update(buf, hyper, split)
    assert torch.allclose(p, 0.95 * p0 - 0.1 * upd, atol=1e-6)
