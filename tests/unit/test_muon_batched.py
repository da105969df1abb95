"""Batched owner math (issue 11, item 4): Newton-Schulz stacked by shape gives the numbers of
the per-matrix loop within fp32 rounding, and AdamW with foreach kernels gives bitwise those of
the per-piece loop.

Batched Newton-Schulz is not bitwise: the CPU BLAS may block a batched product differently from
a single one depending on the machine and its thread count (CI measured a difference where this
machine measured none), and on CUDA batched GEMMs pick other kernels. The tolerance below is
stated against one step's size: a matrix updated with another's direction is off by a step."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mfsdp.optim import adamw, muon
from megatron_mfsdp.optim.rule import OwnedPiece, StepContext

# (shape, split rows): square, wide, tall, a QKV with 2 query groups (Q 32 rows, K and V 16
# per group, so its Q blocks share a shape with the square matrices), and repeats of each.
SHAPES = [((64, 64), None), ((64, 128), None), ((128, 64), None), ((128, 64), (32, 16, 16)), ((64, 64), None)]


def _config(ns_dtype: str, nesterov: bool, algorithm: str = "standard"):
    return SimpleNamespace(
        muon_ns_algorithm=algorithm,
        muon_momentum=0.95,
        muon_use_nesterov=nesterov,
        muon_num_ns_steps=5,
        muon_coefficient_type="quintic",
        muon_ns_dtype=ns_dtype,
        muon_scale_mode="spectral",
        muon_extra_scale_factor=0.2,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
    )


def _pieces(seed: int, shapes, state_names):
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for i, (shape, rows) in enumerate(shapes):
        state = {n: torch.randn(shape, generator=g).abs_() * 0.01 for n in state_names}
        master, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        pieces.append(OwnedPiece(f"p{i}", f"p{i}", "r", master.numel(), 0, master, grad, state, rows))
    return pieces


def _tensors(pieces):
    return [t for p in pieces for t in (p.master, *p.state.values())]


# Largest |batched - per-matrix| allowed in a master after two steps: fp32 reassociation in
# the products (measured up to 2.4e-7), or one bf16 ulp of the orthogonalized update (~0.4% of
# an update of ~3.5e-3 mean size, 1.4e-5). One step changes a master by ~3.5e-3 on average.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-4}


def _max_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(_tensors(a), _tensors(b)))


@pytest.mark.parametrize(
    "ns_dtype,nesterov,algorithm", [("fp32", True, "standard"), ("bf16", False, "standard"), ("fp32", False, "gram")]
)
def test_batched_muon_step_matches_the_per_matrix_step(ns_dtype, nesterov, algorithm, monkeypatch):
    monkeypatch.setattr(muon, "BATCH_ELEMENTS", 3 * 64 * 64)  # also split a shape over two stacks
    batched, looped, start = (_pieces(0, SHAPES * 2, ("momentum_buffer",)) for _ in range(3))
    for step in (1, 2):
        ctx = StepContext(_config(ns_dtype, nesterov, algorithm), step, lr=0.02, weight_decay=0.1)
        muon.step_batched(batched, ctx)
        muon.step_per_matrix(looped, ctx)
    assert _max_difference(batched, looped) <= TOLERANCE[ns_dtype]
    # Negative control: two same-shape matrices whose results were swapped are caught.
    swapped = list(looped)
    swapped[0], swapped[4] = swapped[4], swapped[0]  # both (64, 64)
    assert _max_difference(swapped, looped) > 20 * TOLERANCE[ns_dtype]
    step_size = min((b.master - s.master).abs().mean().item() for b, s in zip(batched, start))
    assert step_size > 20 * TOLERANCE[ns_dtype]  # it did step, by more than the tolerance


@pytest.mark.parametrize(
    "stacked,each,shape,coefficients",
    [
        (muon.newton_schulz_batched, muon.newton_schulz, (3, 96, 40), "simple"),
        (muon.newton_schulz_gram, muon.newton_schulz_gram, (3, 40, 96), "quintic"),
    ],
)
def test_stacked_newton_schulz_matches_each_matrix(stacked, each, shape, coefficients):
    x = torch.randn(shape)
    out = stacked(x, 5, coefficients, torch.float32)
    one_by_one = torch.stack([each(x[i], 5, coefficients, torch.float32) for i in range(shape[0])])
    torch.testing.assert_close(out, one_by_one, rtol=0, atol=1e-5)
    assert (out[0] - one_by_one[1]).abs().max() > 1e-2  # the entries are different matrices


def test_newton_schulz_batched_needs_a_stack():
    with pytest.raises(ValueError, match="stack"):
        muon.newton_schulz_batched(torch.randn(96, 40))


def test_foreach_adamw_is_bitwise_the_per_piece_loop():
    shapes = [((n,), None) for n in (7, 64, 1, 300)]
    foreach, looped = (_pieces(1, shapes, ("exp_avg", "exp_avg_sq")) for _ in range(2))
    for step in (1, 2, 3):
        ctx = StepContext(_config("fp32", False), step, lr=1e-3, weight_decay=0.1)
        adamw.step(foreach, ctx)
        adamw.step_per_piece(looped, ctx)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(foreach), _tensors(looped)))
    adamw.step([], ctx)  # no pieces on this rank: nothing to do
