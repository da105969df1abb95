"""Adaptive Muon's math (megatron_mfsdp/optim/adaptive_muon.py) on one process: against a float64
hand-written formula of Emerging-Optimizers' AdaptiveMuon (v0.3.0 orthogonalized_optimizers/
adaptive_muon.py: raw Newton-Schulz, second moment, Muon's scale once), against pytorch_optimizer's
NorMuon and AdaMuon where their formulas match, Megatron-LM HEAD's double scale (--adaptive-muon-prescale),
the flags, the state and what the rule refuses."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_mfsdp.optim import adaptive_muon as am
from megatron_mfsdp.optim.matrix import step_matrix_
from megatron_mfsdp.optim.muon import STATE, MuonHyper
from megatron_mfsdp.optim.newton_schulz import NewtonSchulz
from megatron_mfsdp.optim.rule import CostContext, OwnedPiece

SIMPLE = (3.4445, -4.7750, 2.0315)  # Jordan's constants: our "simple", pytorch_optimizer's "original"
QKV_ROWS = (4, 2, 2)  # rows per query group of Q, K and V: 4 groups -> a (32, 24) linear_qkv


def _cfg(method="adamuon", *, prescale=False, nesterov=True, ns_dtype=torch.float32, lr=0.02, wd=0.1, **kw):
    """(the step's hyper, lr, weight decay): Muon's momentum 0.9, Jordan's constants, spectral x 0.2."""
    muon = dict(scale_mode="spectral", extra_scale_factor=0.2) | kw
    ns = NewtonSchulz(5, "simple", ns_dtype, "standard")
    settings = am.AdaptiveMuonSettings(method, 0.95, 1e-8, prescale)
    return am.AdaptiveMuonHyper(MuonHyper(0.9, nesterov, ns, **muon), settings), lr, wd


def _data(shape, seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), [torch.randn(shape, generator=gen) for _ in range(steps)]


def _ours(param, grads, cfg, split_rows=None):
    """Our step, returning the parameters after each step and the final state."""
    (hyper, lr, wd), param = cfg, param.clone()
    method = hyper.settings.adaptive_muon_moment2_method
    moment2 = torch.zeros(am.moment2_shape(param.shape, method))
    state = {STATE: torch.zeros_like(param), am.ADAMUON_STATE if hyper.adamuon else am.NORMUON_STATE: moment2}
    out = []
    for step, g in enumerate(grads, 1):
        step_matrix_(am.MATH, param, g.clone(), state, hyper, step, lr=lr, weight_decay=wd, split_rows=split_rows)
        out.append(param.clone())
    return out, moment2


def _ns64(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz in float64, written out: X / |X|_F, then X <- a X + (b A + c A^2) X with A = X X^T
    on the wide orientation."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp_min(1e-7)
    a, b, c = SIMPLE
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _blocks64(d, split_rows):
    if split_rows is None:
        return [d]
    groups = d.shape[0] // sum(split_rows)
    parts = d.reshape(groups, sum(split_rows), d.shape[1]).split(list(split_rows), dim=1)
    return [p.reshape(-1, d.shape[1]) for p in parts]


def _merge64(parts, split_rows, shape):
    if split_rows is None:
        return parts[0]
    groups = shape[0] // sum(split_rows)
    return torch.cat([p.reshape(groups, r, shape[1]) for p, r in zip(parts, split_rows)], dim=1).reshape(shape)


def _scale(shape, extra=0.2):
    return math.sqrt(max(shape)) * extra  # spectral


def _formula64(param, grads, method, split_rows=None, prescale=False, lr=0.02, wd=0.1, mom=0.9, beta2=0.95, eps=1e-8):
    """Emerging-Optimizers' AdaptiveMuon as its source reads, in float64 (prescale: Megatron-LM HEAD's
    TensorParallelMuon scale of each block before the second moment)."""
    p, m = param.double(), torch.zeros(param.shape, dtype=torch.float64)
    v = torch.zeros(am.moment2_shape(param.shape, method), dtype=torch.float64)
    out = []
    for g in grads:
        g = g.double()
        p = p * (1 - lr * wd)
        m = mom * m + (1 - mom) * g
        d = g + mom * (m - g)  # Nesterov: lerp(g, m, momentum)
        parts = [_ns64(b) * (_scale(b.shape) if prescale else 1.0) for b in _blocks64(d, split_rows)]
        o = _merge64(parts, split_rows, d.shape)
        if method == "adamuon":
            v = beta2 * v + (1 - beta2) * o * o
            u = o / (v.sqrt() + eps)
        else:
            v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1 if o.shape[0] >= o.shape[1] else 0, keepdim=True)
            u = o / v.clamp_min(eps).sqrt()
            u = u * (o.norm() / u.norm().clamp_min(eps))
        p = p - lr * _scale(p.shape) * u
        out.append(p)
    return out, v


CASES = [
    ((24, 40), None, False),
    ((40, 24), None, False),
    ((32, 24), QKV_ROWS, False),
    ((32, 24), QKV_ROWS, True),
    ((40, 24), None, True),
]


# (method, NS dtype) -> the largest parameter difference from the float64 formula, relative to the step size
# lr x scale, that the test allows (measured over CASES: fp64 NS 1.3e-5 / 2.3e-7, fp32 NS 1.4e-4 / 1.0e-6;
# adamuon divides by sqrt(v), which magnifies the rounding of entries of O near zero).
FORMULA_TOLERANCE = {
    ("adamuon", torch.float64): 5e-5,
    ("normuon", torch.float64): 1e-6,
    ("adamuon", torch.float32): 5e-4,
    ("normuon", torch.float32): 5e-6,
}


@pytest.mark.parametrize("ns_dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", am.METHODS)
@pytest.mark.parametrize("shape,split_rows,prescale", CASES)
def test_adaptive_muon_equals_the_float64_formula(method, ns_dtype, shape, split_rows, prescale):
    """3 steps from zero weights (so each parameter's rounding is the update's, not a large weight's)
    against the float64 formula: every parameter within FORMULA_TOLERANCE x lr x scale, v within 1e-4
    relative (measured 1.9e-5). Negative control: the other method's formula is over 1e-2 away."""
    _, grads = _data(shape, sum(shape) + len(method) + 3 * prescale)
    param = torch.zeros(shape)
    ours, v = _ours(param, grads, _cfg(method, prescale=prescale, ns_dtype=ns_dtype), split_rows)
    ref, ref_v = _formula64(param, grads, method, split_rows, prescale)
    step = 0.02 * _scale(shape)
    for o, r in zip(ours, ref):
        assert (o.double() - r).abs().max() / step < FORMULA_TOLERANCE[method, ns_dtype]
    torch.testing.assert_close(v.double(), ref_v, rtol=1e-4, atol=1e-12)
    other, _ = _formula64(param, grads, "normuon" if method == "adamuon" else "adamuon", split_rows, prescale)
    assert (ours[-1].double() - other[-1]).abs().max() / step > 1e-2


def test_normuon_equals_pytorch_optimizer_normuon():
    """pytorch_optimizer.NorMuon (Nesterov, Jordan's constants in bf16, update_scale='preserve_norm',
    use_adjusted_lr=False) is Emerging-Optimizers' normuon with its lr scaled by sqrt(max(1, rows/cols)),
    our --muon-scale-mode shape_scaling x 1.0, where rows >= cols (it always averages over the columns).
    It divides by sqrt(v) + eps and by |U| + eps where Emerging-Optimizers multiplies by rsqrt(max(v, eps))
    and divides by max(|U|, eps): 3 steps within 1e-6 x lr (measured 1.9e-7), v within 1e-6 relative
    (measured 8.5e-8). Negative control: a (32, 48) matrix, which Emerging-Optimizers normalizes per column."""
    from pytorch_optimizer import NorMuon

    for shape, agrees in (((32, 32), True), ((48, 32), True), ((32, 48), False)):
        _, grads = _data(shape, 11)
        cfg = _cfg("normuon", ns_dtype=torch.bfloat16, scale_mode="shape_scaling", extra_scale_factor=1.0)
        ours, v = _ours(torch.zeros(shape), grads, cfg)
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = NorMuon([dict(params=[p], use_muon=True)], lr=0.02, momentum=0.9, beta2=0.95, weight_decay=0.1, eps=1e-10)
        worst = 0.0
        for g, o in zip(grads, ours):
            p.grad = g.clone()
            opt.step()
            worst = max(worst, float((p.detach() - o).abs().max()) / 0.02)
        assert (worst < 1e-6) == agrees, (shape, worst)
        if agrees:
            torch.testing.assert_close(opt.state[p]["second_momentum_buffer"], v, rtol=1e-6, atol=0)
        else:
            assert worst > 1e-2


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x.double() / x.double().norm()


def test_adamuon_equals_pytorch_optimizer_adamuon_up_to_its_normalization():
    """pytorch_optimizer.AdaMuon (no Nesterov, bf16 Newton-Schulz) keeps the same v, but divides by the
    bias-corrected sqrt(v / (1 - beta2^t)) and rescales the update to a fixed norm, where Emerging-Optimizers
    multiplies by Muon's scale: per step the updates are proportional. So we compare unit-norm updates and v.
    Its update stays in bf16 (the Newton-Schulz output's dtype) through the division and the rescale, up to
    three bf16 roundings: each entry within 1e-2 relative (measured 6.9e-3); v within 1e-6 relative (measured
    1e-7). Negative control: our Nesterov step is another update."""
    from pytorch_optimizer import AdaMuon

    for shape in ((32, 32), (48, 32), (32, 48)):
        _, grads = _data(shape, 12)
        ours, v = _ours(torch.zeros(shape), grads, _cfg("adamuon", nesterov=False, ns_dtype=torch.bfloat16, wd=0.0))
        nesterov, _ = _ours(torch.zeros(shape), grads, _cfg("adamuon", ns_dtype=torch.bfloat16, wd=0.0))
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = AdaMuon([dict(params=[p], use_muon=True)], lr=0.02, betas=(0.9, 0.95), use_adjusted_lr=False, eps=1e-10)
        before = [torch.zeros(shape)] + ours[:-1]
        for g, o, b in zip(grads, ours, before):
            start = p.detach().clone()
            p.grad = g.clone()
            opt.step()
            theirs = _unit(p.detach() - start)
            assert ((_unit(o - b) - theirs).abs() / theirs.abs()).max() < 1e-2, shape
        assert ((_unit(nesterov[-1] - nesterov[-2]) - theirs).abs() / theirs.abs()).max() > 0.1
        torch.testing.assert_close(opt.state[p]["v"].view(shape), v, rtol=1e-6, atol=0)


@pytest.mark.parametrize("method,factor,tolerance", [("normuon", math.sqrt(40) * 0.2, 1e-6), ("adamuon", 1.0, 2e-5)])
def test_prescale_is_megatron_lm_heads_second_scale(method, factor, tolerance):
    """--adaptive-muon-prescale scales the Newton-Schulz output by Muon's scale before the second moment:
    normuon keeps the Frobenius norm of what it gets, so its update grows by that scale (sqrt(40) x 0.2 on a
    (40, 24) matrix); adamuon divides it out (up to eps). After 3 steps, within 1e-6 (normuon, measured
    1.3e-7) and 2e-5 (adamuon, measured 6.7e-6: eps against a larger sqrt(v)) of the largest weight."""
    _, grads = _data((40, 24), 5)
    once, _ = _ours(torch.zeros(40, 24), grads, _cfg(method, wd=0.0))
    twice, _ = _ours(torch.zeros(40, 24), grads, _cfg(method, prescale=True, wd=0.0))
    assert (twice[-1] - once[-1] * factor).abs().max() / twice[-1].abs().max() < tolerance


def test_flags_are_megatron_lm_heads_optimizer_config_fields():
    """The settings' fields are Megatron-LM HEAD's OptimizerConfig fields (adaptive_muon_moment2_method,
    adaptive_muon_beta2, adaptive_muon_eps) with its defaults, as --adaptive-muon-* flags; bad values are
    refused naming the flag."""
    from megatron_mfsdp.training.arguments.ours import add_rule_args

    parser = argparse.ArgumentParser()
    add_rule_args(parser)
    args = parser.parse_args([])
    assert (args.adaptive_muon_moment2_method, args.adaptive_muon_beta2, args.adaptive_muon_eps) == (
        "adamuon",
        0.95,
        1e-8,
    )
    assert args.adaptive_muon_prescale is False
    args = parser.parse_args(["--adaptive-muon-moment2-method", "normuon", "--adaptive-muon-beta2", "0.9"])
    assert (args.adaptive_muon_moment2_method, args.adaptive_muon_beta2) == ("normuon", 0.9)
    assert parser.parse_args(["--adaptive-muon-prescale"]).adaptive_muon_prescale is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--adaptive-muon-moment2-method", "namo"])
    with pytest.raises(ValueError, match="--adaptive-muon-beta2"):
        am.AdaptiveMuonSettings(adaptive_muon_beta2=1.5)
    with pytest.raises(ValueError, match="--adaptive-muon-eps"):
        am.AdaptiveMuonSettings(adaptive_muon_eps=0.0)


def _piece(shape, split_rows=None, **kw):
    master = torch.zeros(shape)
    return OwnedPiece(
        "w", "w", "adaptive_muon", master.numel(), 0, master, torch.zeros(shape), split_rows=split_rows, **kw
    )


def test_state_cost_and_what_the_rule_refuses():
    """adamuon's v is param-shaped (split like the parameter in checkpoints); normuon's one value per row
    (rows >= cols) or column, saved whole, of the whole TP-split matrix under an exact TP mode. The planner
    cost is Muon's plus the elementwise work; a Q, K or V block placed apart is refused."""
    from megatron_mfsdp.config import MatrixFSDPOptimizerConfig
    from megatron_mfsdp.optim.muon import rule_cost

    normuon = {"adaptive_muon": am.AdaptiveMuonSettings("normuon")}
    cfg = MatrixFSDPOptimizerConfig(optimizer="adaptive_muon", rule_settings=normuon, muon_tp_mode="duplicated")
    assert am.RULE.state_over_tp(cfg) and not am.RULE.state_over_tp(MatrixFSDPOptimizerConfig(optimizer="muon"))
    adamuon_state = am.RULE.init_state(_piece((40, 24)), am.AdaptiveMuonSettings())
    assert {k: tuple(v.shape) for k, v in adamuon_state.items()} == {
        "momentum_buffer": (40, 24),
        am.ADAMUON_STATE: (40, 24),
    }
    assert tuple(am.RULE.init_state(_piece((24, 40)), normuon["adaptive_muon"])[am.NORMUON_STATE].shape) == (1, 40)
    over_tp = _piece((20, 24), partition_dim=0, tp_size=2, state_over_tp=True)
    assert tuple(am.RULE.init_state(over_tp, normuon["adaptive_muon"])[am.NORMUON_STATE].shape) == (40, 1)
    assert am.RULE.resharded(am.ADAMUON_STATE) and not am.RULE.resharded(am.NORMUON_STATE)
    context = CostContext(cfg, on_cpu=True)
    assert am.RULE.cost((40, 24), None, context) == rule_cost((40, 24), None, context) + 6 * 40 * 24
    assert am.RULE.resident_bytes((40, 24), context) == 4 * (40 * 24 + 40)
    with pytest.raises(ValueError, match="--mfsdp-split-qkv-owners"):
        am.RULE.check(_piece((16, 24), split_rows=(4,)), cfg)
    with pytest.raises(ValueError, match="--muon-tp-mode duplicated"):
        am.RULE.check(_piece((16, 24), split_rows=QKV_ROWS, partition_dim=1, tp_size=2), cfg)
    am.RULE.check(_piece((32, 24), split_rows=QKV_ROWS, partition_dim=0, tp_size=2), cfg)  # column-parallel QKV: fine


def test_elementwise_parameters_take_muon_scalar_optimizer():
    """--optimizer adaptive_muon sends the elementwise parameters to --muon-scalar-optimizer (adam: AdamW, or
    lion), as Megatron-LM HEAD rewrites its default param overrides for muon and adaptive_muon."""
    from megatron_mfsdp.config import MatrixFSDPOptimizerConfig
    from megatron_mfsdp.optim import registry

    for scalar, rule in (("adam", "adamw"), ("lion", "lion")):
        cfg = MatrixFSDPOptimizerConfig(optimizer="adaptive_muon", muon_scalar_optimizer=scalar)
        assert registry.optimizer_rule("adaptive_muon") is am.RULE and registry.elementwise_rule(cfg).name == rule
