"""Shampoo's math on one matrix (megatron_mfsdp/optim/shampoo.py) against an independent implementation
and by hand.

The cross-check is ``pytorch_optimizer.ScalableShampoo`` 4.1.0 (kozistr; pytorch_optimizer/optimizer/
shampoo.py and utils/preconditioner.py, utils/graft.py, utils/partition.py), the one of its two Shampoos
with blocking and grafting (``Shampoo`` has neither). Matched: factor EMA ``betas[1]`` = our shampoo_beta
= the graft's beta2, roots -1/4 (``exponent = 2 * rank``), refresh at every multiple of the frequency
from ``start_preconditioning_step`` = frequency on, blocks cut as ``torch.split`` cuts them, its roots by
SVD (``use_svd``) where ours are by eigh. Its differences, and how the test removes them:

- its graft is RMSProp without bias correction, ours Adam with it: with both epsilons 0 and beta1 = 0,
  ours is exactly sqrt(1 - beta2^t) times its direction (the graft norm carries the factor), so its
  direction is multiplied by that;
- its momentum acts on the grafted direction, ours (Distributed Shampoo's) filters the gradient before:
  beta1 = 0 here (beta1 is checked by hand in float64);
- its statistics start at eps I and decay it (ours: eps I added after bias correction) and it has no
  bias correction of the factors: the scale cancels in the grafting, and eps = 1e-12 is below the
  eigenvalues wherever the direction has a part (each factor is full rank at the first refresh, or the
  gradients stay in its range: a gradient's part in a factor's null space is scaled by eps^-1/4, and
  the two eps conventions differ there);
- it grafts the whole matrix's norm, ours each block's: with blocking, each block's direction is
  compared after normalizing it to unit norm.

Measured max |ours - theirs| / max |theirs| over 6 steps (frequency 2): float64 random 8 x 12 and
12 x 12 9.8e-12 (asserted 1e-10), float64 rank 3 16 x 10 (a fixed low-rank subspace, so the factors
stay rank-deficient) 3.3e-9 (asserted 1e-7), float32 random 1.03e-6 (asserted 1e-5); blocks of a
13 x 14 matrix cut at 5, unit-normalized, 3.9e-11 (asserted 1e-9). float32 on an
exactly rank-deficient factor is not compared: the roots amplify its rounding in the null space by
eps^-1/4 (about 1e3) and the direction differs from float64's by O(1) (Distributed Shampoo's fp32
default has the same property). The negative control (roots -1/2 in theirs) differs by >= 0.35 (asserted > 0.1).
"""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_optimizer import ScalableShampoo
from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting
from torch.utils.flop_counter import FlopCounterMode

from megatron_mfsdp.optim import shampoo as sh
from megatron_mfsdp.optim.adamw import adamw_step_
from megatron_mfsdp.optim.rule import CostContext
from megatron_mfsdp.testing import optimizer_config

BETA = 0.99
FREQ = 2
STEPS = 6


def _grads(shape, steps, rank=None, seed=0) -> list[torch.Tensor]:
    """float64 gradients: iid normal, or of a fixed rank-``rank`` subspace (low-rank factors)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if rank is None:
        return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]
    left = torch.randn(rows, rank, generator=gen, dtype=torch.float64)
    right = torch.randn(cols, rank, generator=gen, dtype=torch.float64)
    return [left @ torch.randn(rank, rank, generator=gen, dtype=torch.float64) @ right.T for _ in range(steps)]


def _theirs(grads, block, exponent=0) -> list[torch.Tensor]:
    """ScalableShampoo's direction each step (lr 1 from a zero parameter), times sqrt(1 - beta2^t)."""
    p = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = ScalableShampoo(
        [p],
        lr=1.0,
        betas=(0.0, BETA),
        start_preconditioning_step=FREQ,
        preconditioning_compute_steps=FREQ,
        block_size=block,
        shape_interpretation=False,
        graft_type=LayerWiseGrafting.RMSPROP,
        nesterov=False,
        diagonal_eps=0.0,
        matrix_eps=1e-12,
        use_svd=True,
        inverse_exponent_override=exponent,
    )
    out = []
    for t, g in enumerate(grads, 1):
        with torch.no_grad():
            p.zero_()
        p.grad = g.clone()
        opt.step()
        out.append(-p.detach().clone() * math.sqrt(1 - BETA**t))
    return out


def _settings(**kw) -> sh.ShampooSettings:
    base = dict(shampoo_beta=BETA, shampoo_precondition_frequency=FREQ, shampoo_max_precond_dim=64)
    return sh.ShampooSettings(**{**base, **kw})


def _ours(grads, dtype, hyper: sh.ShampooHyper, state=None) -> list[torch.Tensor]:
    """Our directions of ``grads`` in ``dtype`` (state cast to it), float64 out."""
    if state is None:
        state = {k: v.to(dtype) for k, v in sh.init(tuple(grads[0].shape), hyper.settings).items()}
    return [sh.direction(g.to(dtype), state, hyper, t).double() for t, g in enumerate(grads, 1)]


def _max_rel(ours, theirs) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs))


@pytest.mark.parametrize(
    "shape,rank,dtype,tol",
    [
        ((8, 12), None, torch.float64, 1e-10),
        ((12, 12), None, torch.float64, 1e-10),
        ((16, 10), 3, torch.float64, 1e-7),
        ((8, 12), None, torch.float32, 1e-5),
        ((12, 12), None, torch.float32, 1e-5),
    ],
)
def test_matches_scalable_shampoo(shape, rank, dtype, tol):
    """Six steps, a refresh every second one: Adam before the first root, grafted Shampoo after."""
    grads = _grads(shape, STEPS, rank)
    theirs = _theirs(grads, block=64)
    hyper = sh.ShampooHyper(_settings(), beta1=0.0, beta2=BETA, eps=0.0)
    assert _max_rel(_ours(grads, dtype, hyper), theirs) < tol
    if dtype == torch.float64:  # negative control: -1/2 roots in theirs are told apart
        assert _max_rel(_ours(grads, dtype, hyper), _theirs(grads, block=64, exponent=2)) > 0.1


def test_blocks_match_scalable_shampoo_block_by_block():
    """A 13 x 14 matrix cut at 5 (blocks 5, 5, 3 by 5, 5, 4): before the first root the whole direction
    (Adam's) agrees; after it each block's direction agrees up to its norm (it grafts the whole matrix).
    Every block's factors are full rank by the first refresh (two steps): a later gradient's part in a
    factor's null space is scaled by eps^-1/4 with its eps convention or ours, which differ (a 12 x 13
    matrix cut at 5, with 2-row blocks, differs by 4e-2 at step 3)."""
    grads = _grads((13, 14), STEPS)
    theirs = _theirs(grads, block=5)
    hyper = sh.ShampooHyper(_settings(shampoo_max_precond_dim=5), beta1=0.0, beta2=BETA, eps=0.0)
    ours = _ours(grads, torch.float64, hyper)
    assert _max_rel(ours[: FREQ - 1], theirs[: FREQ - 1]) < 1e-12
    worst = 0.0
    for a, b in zip(ours[FREQ - 1 :], theirs[FREQ - 1 :]):
        for rows, cols in sh.blocks(a.shape, 5):
            x, y = a[rows, cols], b[rows, cols]
            worst = max(worst, (x / x.norm() - y / y.norm()).abs().max().item())
    assert worst < 1e-9
    assert len(sh.blocks((13, 14), 5)) == 9


@pytest.mark.parametrize("shape", [(6, 6), (5, 8)])
def test_one_step_float64_by_hand(shape):
    """First step with roots (start 1): with beta1 = 0.9, the bias-corrected moments are G and G^2, L = G G^T
    = U S^2 U^T, so the left root is U (S^2 + eps)^-1/4 U^T and the direction U diag(s / sqrt(s^2 + eps))
    V^T (the polar factor, R's null space untouched) rescaled to ||G / (|G| + eps_adam)||: by SVD, not eigh.
    Measured: 2.9e-15 (6 x 6) and 1.8e-12 (5 x 8: R's null space scales rounding by eps^-1/4) on entries
    of about 2."""
    eps, adam_eps = 1e-12, 1e-8
    g = _grads(shape, 1, seed=3)[0]
    hyper = sh.ShampooHyper(_settings(shampoo_start_preconditioning_step=1, shampoo_beta=0.9), 0.9, 0.95, adam_eps)
    state = {k: v.double() for k, v in sh.init(shape, hyper.settings).items()}
    got = sh.direction(g, state, hyper, 1)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    if shape[0] == shape[1]:
        left_root = u @ torch.diag((s**2 + eps) ** -0.25) @ u.T
        right_root = vh.T @ torch.diag((s**2 + eps) ** -0.25) @ vh
        torch.testing.assert_close(state["left_root_0"], left_root, rtol=1e-12, atol=0)
        torch.testing.assert_close(state["right_root_0"], right_root, rtol=1e-12, atol=0)
    polar = u @ torch.diag(s / torch.sqrt(s**2 + eps)) @ vh
    graft_norm = (g / (g.abs() + adam_eps)).norm()
    torch.testing.assert_close(got, polar * graft_norm / polar.norm(), rtol=1e-10, atol=1e-11)
    # Negative controls: the ungrafted polar factor, and -1/2 roots (U S^-1 ... V^T scaled), differ.
    assert (got - polar).abs().max() > 0.1
    half = u @ torch.diag(s / (s**2 + eps)) @ vh
    assert (got - half * graft_norm / half.norm()).abs().max() > 0.1


def test_blocked_matrix_equals_each_block_alone():
    """Blocks are independent: a 10 x 13 matrix cut at 4 gives, block by block, bitwise what running each
    block alone (one block) gives, directions and factors, over 5 steps with two refreshes."""
    grads = [g.float() for g in _grads((10, 13), 5, seed=1)]
    hyper = sh.ShampooHyper(_settings(shampoo_max_precond_dim=4), 0.9, 0.95, 1e-8)
    whole_state = sh.init((10, 13), hyper.settings)
    whole = [sh.direction(g, whole_state, hyper, t) for t, g in enumerate(grads, 1)]
    alone_hyper = sh.ShampooHyper(_settings(), 0.9, 0.95, 1e-8)
    for k, (rows, cols) in enumerate(sh.blocks((10, 13), 4)):
        part = [g[rows, cols].contiguous() for g in grads]
        state = sh.init(tuple(part[0].shape), alone_hyper.settings)
        alone = [sh.direction(g, state, alone_hyper, t) for t, g in enumerate(part, 1)]
        for t, (w, a) in enumerate(zip(whole, alone), 1):
            assert torch.equal(w[rows, cols], a), (k, t)
        for name in ("left", "right", "left_root", "right_root"):
            assert torch.equal(whole_state[f"{name}_{k}"], state[f"{name}_0"]), (k, name)
    assert len(sh.blocks((10, 13), 4)) == 12


def test_roots_change_only_at_refresh_steps():
    """Frequency 3, start 3: steps 1-2 are AdamW's update (to 1e-6: adamw.py divides by the bias correction
    elsewhere) and compute no root; the roots are computed at 3, kept bitwise through 4 and 5, recomputed at 6."""
    grads = [g.float() for g in _grads((6, 9), 8, seed=2)]
    hyper = sh.ShampooHyper(_settings(shampoo_precondition_frequency=3), 0.9, 0.95, 1e-8)
    state = sh.init((6, 9), hyper.settings)
    param, m, v = torch.zeros(6, 9), torch.zeros(6, 9), torch.zeros(6, 9)
    roots = []
    for t, g in enumerate(grads, 1):
        d = sh.direction(g, state, hyper, t)
        roots.append(state["left_root_0"].clone())
        if t < 3:
            param.zero_()
            adamw_step_(param, g, m, v, lr=1.0, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8,
                        bias_correction1=1 - 0.9**t, bias_correction2=1 - 0.95**t)  # fmt: skip
            torch.testing.assert_close(d, -param, rtol=1e-6, atol=0)
    assert not roots[1].any()
    assert torch.equal(roots[2], roots[3]) and torch.equal(roots[2], roots[4])
    assert not torch.equal(roots[4], roots[5])
    assert torch.equal(roots[5], roots[6]) and torch.equal(roots[5], roots[7])


def test_refresh_schedule_is_distributed_shampoos():
    """Roots at ``start`` and at every multiple of the frequency after it; start 0 means the frequency."""
    s = _settings(shampoo_precondition_frequency=3, shampoo_start_preconditioning_step=4)
    assert [t for t in range(1, 13) if s.refreshes(t)] == [4, 6, 9, 12]
    s = _settings(shampoo_precondition_frequency=5)
    assert s.start == 5 and [t for t in range(1, 16) if s.refreshes(t)] == [5, 10, 15]


def _counted_multiply_adds(shape, settings, steps) -> list[int]:
    """Matmul multiply-adds each step runs (torch's flop counter; in-place addmm_ counted as addmm)."""

    def addmm_(self_shape, a, b, *args, out_shape=None, **kw):
        return 2 * a[0] * a[1] * b[1]

    hyper, state, out = sh.ShampooHyper(settings), sh.init(shape, settings), []
    for t in range(1, steps + 1):
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
            sh.direction(torch.randn(shape), state, hyper, t)
        out.append(counter.get_total_flops() // 2)
    return out


def test_planner_cost_counts_what_the_step_runs():
    """cost = a plain step's counted multiply-adds + (a refresh's extra counted ones, forming the roots,
    + eigh's 4.5 n^3 per factor) / frequency; state_bytes = the bytes init allocates."""
    shape, freq = (20, 28), 4
    settings = _settings(shampoo_precondition_frequency=freq, shampoo_max_precond_dim=8)
    counted = _counted_multiply_adds(shape, settings, 2 * freq)
    plain, refresh = counted[freq], counted[2 * freq - 1]  # step 5 (roots kept), step 8 (refreshed)
    assert counted[freq - 1] == refresh > plain  # step 4: the first roots
    cubes = sum(r**3 + c**3 for r, c in sh.block_shapes(shape, 8))
    context = CostContext(optimizer_config(optimizer="shampoo", rule_settings={"shampoo": settings}))
    expected = plain + (refresh - plain + 4.5 * cubes) / freq
    assert abs(sh.cost(shape, None, context) - expected) <= len(sh.blocks(shape, 8))
    allocated = sum(t.numel() * t.element_size() for t in sh.init(shape, settings).values())
    assert sh.state_bytes(shape, context) == allocated


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("shampoo_beta", 1.5, "--shampoo-beta"),
        ("shampoo_epsilon", 0.0, "--shampoo-epsilon"),
        ("shampoo_precondition_frequency", 0, "--shampoo-precondition-frequency"),
        ("shampoo_start_preconditioning_step", -1, "--shampoo-start-preconditioning-step"),
        ("shampoo_max_precond_dim", 0, "--shampoo-max-precond-dim"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        sh.ShampooSettings(**{field: value})
