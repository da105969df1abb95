"""--optimizer adaptive_muon (adamuon and normuon) held to the single-process reference
(megatron_mfsdp/testing/exactness.py): DP 2 and DP 4 with 1 and 4 micro-batches, PP 2, TP 2 duplicated (at the
optimizer) and --mfsdp-layout even bitwise; TP 2 distributed within a stated tolerance. The owner step's
only collective is the gradient statistics; duplicated adds one TP all-gather per matrix, even one DP
gather per matrix. One run_workers per world size."""

import torch

from megatron_mfsdp.optim.adaptive_muon import NORMUON_STATE, AdaptiveMuonSettings
from megatron_mfsdp.testing import optimizer_config, run_workers
from megatron_mfsdp.testing.exactness import (
    reference_worker,
    tiny_dp_run,
    tp_reference_worker,
    tp_step_worker,
    train_worker,
)

STEPS = 2
RUNS = [(STEPS, 1), (STEPS, 4)]
METHODS = {
    name: {"optimizer": "adaptive_muon", "rule_settings": {"adaptive_muon": AdaptiveMuonSettings(name)}}
    for name in ("adamuon", "normuon")
}
HIDDEN = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
DISTRIBUTED_TOLERANCE = {"adamuon": 1e-3, "normuon": 1e-5}
"""TP 2 distributed against TP 1: the largest Frobenius norm of a weight's difference relative to the weight's.
Its Newton-Schulz sums the Gram matrix of the shards (newton_schulz.py distributed_newton_schulz), not the whole
matrix's products: 1.3e-6
for normuon (as for Muon); adamuon divides each entry of O by its own RMS over steps, which magnifies the
difference of entries near zero (measured 9.2e-5, one entry 8.7e-4 off)."""


def _tasks(rank, world_size, tasks):
    """Every task of one world size in one start of the workers: ``fn(rank, world_size, *args)`` each."""
    return [fn(rank, world_size, *args) for fn, args in tasks]


def _even_worker(rank, world_size, opt_overrides, steps):
    """The tiny GPT at DP = world under --mfsdp-layout even (every parameter an even slice): its weights,
    the rules of its pieces and each step's collectives."""
    ddp, opt, step_calls = tiny_dp_run(rank, optimizer_config(**opt_overrides), steps, layout="even")
    rules = sorted({(o.rule, o.master.dim()) for o in opt.owned_pieces()})
    return {"params": ddp.full_state_dict(), "rules": rules, "step_calls": step_calls}


def _with(method: str, **overrides) -> dict:
    return {**METHODS[method], **overrides}


def _world1_tasks(method):
    """The references of one method: DP 2, DP 4, DP 1 (for PP 2), TP 1 on synthetic gradients."""
    m = METHODS[method]
    return [
        (reference_worker, (m, RUNS, 2)),
        (reference_worker, (m, RUNS, 4)),
        (reference_worker, (m, [(STEPS, 1)], 1)),
        (tp_reference_worker, (m, STEPS)),
    ]


def _world2_tasks(method):
    return [
        (train_worker, (METHODS[method], RUNS)),
        (train_worker, (METHODS[method], [(STEPS, 1)], 2)),
        (tp_step_worker, (_with(method, muon_tp_mode="duplicated"), STEPS)),
        (tp_step_worker, (_with(method, muon_tp_mode="distributed"), STEPS)),
        (_even_worker, (METHODS[method], STEPS)),
    ]


def _assert_equal(got: dict, reference: dict, what: str) -> None:
    assert set(got) == set(reference), what
    for name, ref in reference.items():
        assert torch.equal(got[name], ref), f"{what}: {name}"


def _assert_stats_only(step_calls, what: str) -> None:
    assert all(calls == [("all_reduce", 2)] for calls in step_calls), (what, step_calls)


def _check_dp_and_pp(method, refs, world2, dp4):
    ref_dp2, ref_dp4, ref_pp = refs[:3]
    for world, runs, ref_runs in (("DP2", world2[0][0], ref_dp2), ("DP4", dp4, ref_dp4)):
        for (_, micro), run, ref in zip(RUNS, runs, ref_runs):
            _assert_equal(run["params"], ref["params"], f"{method} {world} x {micro} micro-batches")
            _assert_stats_only(run["step_calls"], f"{method} {world} x {micro}")
    pp2 = {name: p for rank in world2 for name, p in rank[1][0]["params"].items()}  # both stages'
    _assert_equal(pp2, ref_pp[0]["params"], f"{method} PP2")
    for rank in world2:
        _assert_stats_only(rank[1][0]["step_calls"], f"{method} PP2")


def _check_tp(method, ref_tp, world2):
    """Duplicated: bitwise TP 1, normuon's whole-matrix v on TP rank 0 too; each step the statistics then one
    all-gather of each hidden matrix (its whole and its shard's elements). Distributed: within tolerance."""
    duplicated, distributed = world2[0][2], world2[0][3]
    _assert_equal(duplicated["params"], ref_tp["params"], f"{method} TP2 duplicated")
    gathered = sorted(p.numel() * 3 // 2 for n, p in ref_tp["params"].items() if n.endswith(HIDDEN))
    for calls in duplicated["step_calls"]:
        assert calls[0] == ("all_reduce", 2) and {c.name for c in calls[1:]} == {"all_gather_single"}, calls
        assert sorted(c[1] for c in calls[1:]) == gathered
    if method == "normuon":
        for name, state in duplicated["state"].items():
            assert torch.equal(state[NORMUON_STATE], ref_tp["state"][name][NORMUON_STATE]), name
    worst = max(float((distributed["params"][n] - p).norm() / p.norm()) for n, p in ref_tp["params"].items())
    assert 0 < worst < DISTRIBUTED_TOLERANCE[method], worst


def _check_even(method, ref_dp2, world2):
    """Even equals the reference (and so the owner layout) bitwise; its step gathers each hidden matrix once."""
    even = world2[0][4]
    _assert_equal(even["params"], ref_dp2[0]["params"], f"{method} even")
    _assert_equal(even["params"], world2[0][0][0]["params"], f"{method} even vs owner")
    assert even["rules"] == [("adamw", 1), ("adaptive_muon_even", 1)]
    for calls in even["step_calls"]:
        assert calls[0] == ("all_reduce", 2) and [c.name for c in calls[1:]] == ["all_to_all_single"] * 8, calls


def test_adaptive_muon_bitwise_the_reference_at_dp_pp_tp_and_even():
    references = run_workers(
        1,
        _tasks,
        _world1_tasks("adamuon")
        + _world1_tasks("normuon")
        + [
            (reference_worker, ({}, [(STEPS, 1)], 2)),
        ],
    )[0]
    world2 = run_workers(2, _tasks, _world2_tasks("adamuon") + _world2_tasks("normuon"))
    world4 = run_workers(4, _tasks, [(train_worker, (METHODS[m], RUNS)) for m in METHODS])[0]
    for i, method in enumerate(METHODS):
        refs, mine = references[4 * i : 4 * i + 4], [rank[5 * i : 5 * i + 5] for rank in world2]
        _check_dp_and_pp(method, refs, mine, world4[i])
        _check_tp(method, refs[3], mine)
        _check_even(method, refs[0], mine)
    # Negative controls: Muon's weights, and the other method's, differ from these.
    muon, adamuon, normuon = references[8][0]["params"], references[0][0]["params"], references[4][0]["params"]
    assert any(not torch.equal(muon[n], p) for n, p in adamuon.items())
    assert any(not torch.equal(normuon[n], p) for n, p in adamuon.items())


def _tiny_flags(*extra: str) -> list[str]:
    """tests/launch.py's TINY without its --optimizer, plus ``extra``."""
    from tests.launch import TINY

    at = TINY.index("--optimizer")
    return [*TINY[:at], *TINY[at + 2 :], "--eval-iters", "0", "--optimizer", "adaptive_muon", *extra]


def test_optimizer_adaptive_muon_through_the_command_line(tmp_path):
    """pretrain_gpt.py's flags: --use-matrix-fsdp --optimizer adaptive_muon trains with either method (the loss
    falls over 5 iterations, differently per method); without --use-matrix-fsdp (megatron-core 0.16.1 has no
    adaptive_muon) the replicated backend runs the same rule: the same losses within 1e-6."""
    from tests.launch import pretrain_in_workers, train_losses

    def losses(*extra):
        return train_losses(pretrain_in_workers(2, *_tiny_flags(*extra), tmp_path=tmp_path))

    adamuon = losses("--use-matrix-fsdp")
    normuon = losses("--use-matrix-fsdp", "--adaptive-muon-moment2-method", "normuon", "--adaptive-muon-beta2", "0.9")
    replicated = losses()
    for run in (adamuon, normuon):
        assert len(run) == 5 and run[-1] < run[0] - 0.1, run
    assert adamuon[2:] != normuon[2:]
    assert max(abs(a - b) for a, b in zip(adamuon, replicated)) < 1e-6, (adamuon, replicated)
