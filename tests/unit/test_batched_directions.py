"""Batched directions (issue 27): a rank's same-shape matrices stacked through a rule's ``batched``
hook (optim/matrix.py) give the numbers of the per-matrix loop within stated tolerances, per rule;
AdamW with foreach kernels gives bitwise those of the per-piece loop.

A stacked product is not bitwise the loop's in general: the CPU BLAS may block a batched product
differently from a single one depending on the machine and its thread count (CI once measured a
difference where the development machine measured none), and on CUDA batched GEMMs pick other
kernels; a stack also takes the plain Newton-Schulz products where one matrix on a CPU takes the
symmetric ones (newton_schulz.uses_symmetric). The tolerance is stated against one step's size: a
matrix updated with another's direction is off by a step, which the negative control shows."""

from types import SimpleNamespace

import pytest
import torch

from megatron_mfsdp.optim import adamw, adaptive_muon, matrix, soap
from megatron_mfsdp.optim.rule import OwnedPiece, StepContext
from megatron_mfsdp.testing import optimizer_config

# (shape, split rows): square, wide, tall, a QKV with 2 query groups (Q 32 rows, K and V 16
# per group), and repeats of each.
SHAPES = [((64, 64), None), ((64, 128), None), ((128, 64), None), ((128, 64), (32, 16, 16)), ((64, 64), None)]

# Largest |batched - loop| allowed in a master after two steps: fp32 reassociation in the products
# (measured up to 2.4e-7), or one bf16 ulp of the orthogonalized update (~0.4% of an update of
# ~3.5e-3 mean size, 1.4e-5). One step changes a master by ~3.5e-3 on average.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-4}

CONFIGS = {
    "muon fp32 nesterov": ({}, {"muon_ns_dtype": "fp32"}),
    "muon bf16": ({"muon_use_nesterov": False}, {"muon_ns_dtype": "bf16", "muon_coefficient_type": "quintic"}),
    "muon fp32 gram": ({"muon_use_nesterov": False}, {"muon_ns_dtype": "fp32", "muon_ns_algorithm": "gram"}),
    "adamuon fp32": ({"optimizer": "adaptive_muon"}, {"muon_ns_dtype": "fp32"}),
    "normuon fp32": (
        {
            "optimizer": "adaptive_muon",
            "rule_settings": {"adaptive_muon": adaptive_muon.AdaptiveMuonSettings("normuon")},
        },
        {"muon_ns_dtype": "fp32"},
    ),
    "soap": ({"optimizer": "soap"}, {}),
    "soap paper order": (
        {"optimizer": "soap", "rule_settings": {"soap": soap.SoapSettings(soap_basis="previous")}},
        {},
    ),
}


def _config(name: str):
    overrides, muon = CONFIGS[name]
    return optimizer_config(**overrides, **muon)


def _pieces(seed: int, rule, config, shapes):
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for i, (shape, rows) in enumerate(shapes):
        master, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        piece = OwnedPiece(f"p{i}", f"p{i}", rule.name, master.numel(), 0, master, grad, split_rows=rows)
        piece.param_shape = shape
        piece.state = rule.init_state(piece, rule.settings_in(config))
        for t in piece.state.values():
            t.copy_(torch.randn(t.shape, generator=g).abs_() * 0.01)
        pieces.append(piece)
    return pieces


def _tensors(pieces):
    return [t for p in pieces for t in (p.master, *p.state.values())]


def _max_difference(a, b):
    return max((x - y).abs().max().item() for x, y in zip(_tensors(a), _tensors(b)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_step_matches_the_per_matrix_loop(name, monkeypatch):
    from megatron_mfsdp.optim import registry

    config = _config(name)
    rule = registry.optimizer_rule(config.optimizer)
    tolerance = TOLERANCE[config.rule_settings["muon"].muon_ns_dtype]
    monkeypatch.setattr(matrix, "BATCH_ELEMENTS", 3 * 64 * 64)  # also split a shape over two stacks
    batched, looped, start = (_pieces(0, rule, config, SHAPES * 2) for _ in range(3))
    calls, stacks = [], matrix.stacks
    monkeypatch.setattr(matrix, "stacks", lambda pieces: calls.extend(len(s) for s in stacks(pieces)) or stacks(pieces))
    for step in (1, 2):
        ctx = StepContext(config, step, lr=0.02, weight_decay=0.1, settings=rule.settings_in(config))
        monkeypatch.setattr(matrix, "FORCE_BATCHED", True)
        rule.step(batched, ctx)
        monkeypatch.setattr(matrix, "FORCE_BATCHED", False)
        rule.step(looped, ctx)
    assert calls and max(calls) == 3  # the stacks did run, three (64, 64) matrices at most per stack
    assert _max_difference(batched, looped) <= tolerance
    # Negative control: two same-shape matrices whose results were swapped are caught.
    swapped = list(looped)
    swapped[0], swapped[4] = swapped[4], swapped[0]  # both (64, 64)
    assert _max_difference(swapped, looped) > 20 * tolerance
    step_size = min((b.master - s.master).abs().mean().item() for b, s in zip(batched, start))
    assert step_size > 20 * tolerance  # it did step, by more than the tolerance


@pytest.mark.parametrize(
    "stacked,each,shape,coefficients",
    [
        ("newton_schulz_batched", "newton_schulz", (3, 96, 40), "simple"),
        ("newton_schulz_gram", "newton_schulz_gram", (3, 40, 96), "quintic"),
    ],
)
def test_stacked_newton_schulz_matches_each_matrix(stacked, each, shape, coefficients):
    from megatron_mfsdp.optim import newton_schulz as ns

    x = torch.randn(shape)
    out = getattr(ns, stacked)(x, 5, coefficients, torch.float32)
    one_by_one = torch.stack([getattr(ns, each)(x[i], 5, coefficients, torch.float32) for i in range(shape[0])])
    torch.testing.assert_close(out, one_by_one, rtol=0, atol=1e-5)
    assert (out[0] - one_by_one[1]).abs().max() > 1e-2  # the entries are different matrices


def test_newton_schulz_batched_needs_a_stack():
    from megatron_mfsdp.optim import newton_schulz as ns

    with pytest.raises(ValueError, match="stack"):
        ns.newton_schulz_batched(torch.randn(96, 40))


def test_where_the_owner_batches():
    """By default: each rule's batched hook on CUDA (matrix.BATCHED_ON), none on a CPU (the loop keeps the
    single-process reference's sums: the exactness tests); SOAP's nowhere (its batched_on, measured)."""
    from megatron_mfsdp.optim import muon

    steps = {name: rule.step.__self__ for name, rule in (("muon", muon.RULE), ("soap", soap.RULE))}
    assert steps["muon"]._batches("cuda") and not steps["muon"]._batches("cpu")
    assert not steps["soap"]._batches("cuda") and not steps["soap"]._batches("cpu")


def _adam_config():
    return SimpleNamespace(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def _flat_pieces(seed: int, sizes):
    g = torch.Generator().manual_seed(seed)
    pieces = []
    for i, n in enumerate(sizes):
        state = {k: torch.randn(n, generator=g).abs_() * 0.01 for k in ("exp_avg", "exp_avg_sq")}
        master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
        pieces.append(OwnedPiece(f"p{i}", f"p{i}", "adamw", n, 0, master, grad, state))
    return pieces


def test_foreach_adamw_is_bitwise_the_per_piece_loop():
    foreach, looped = (_flat_pieces(1, (7, 64, 1, 300)) for _ in range(2))
    for step in (1, 2, 3):
        ctx = StepContext(_adam_config(), step, lr=1e-3, weight_decay=0.1)
        adamw.step(foreach, ctx)
        adamw.step_per_piece(looped, ctx)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(foreach), _tensors(looped)))
    adamw.step([], ctx)  # no pieces on this rank: nothing to do
