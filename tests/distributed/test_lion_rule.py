"""--optimizer lion (Lion on every parameter) and --muon-scalar-optimizer lion (Lion on Muon's elementwise
parameters) held to the single-process reference (megatron_mfsdp/testing/exactness.py): DP 2 and DP 4 with 1
and 4 micro-batches, PP 2 and TP 2 (at the optimizer) bitwise, with the gradient statistics as the step's
only collective. One run_workers per world size."""

import torch

from megatron_mfsdp.optim.lion import LionSettings
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
LION = {"optimizer": "lion"}
MUON_LION = {"optimizer": "muon", "muon_scalar_optimizer": "lion"}
OTHER_BETAS = {"optimizer": "lion", "rule_settings": {"lion": LionSettings(0.9, 0.99)}}
HIDDEN = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _tasks(rank, world_size, tasks):
    """Every task of one world size in one start of the workers: ``fn(rank, world_size, *args)`` each."""
    return [fn(rank, world_size, *args) for fn, args in tasks]


def _rules_worker(rank, world_size, opt_overrides, steps):
    """The tiny GPT at DP = world, trained ``steps`` steps: its weights, the rule of every piece this rank
    owns (by global name) and each step's collectives."""
    ddp, opt, step_calls = tiny_dp_run(rank, optimizer_config(**opt_overrides), steps)
    rules = {(o.global_name, o.rule) for o in opt.owned_pieces()}
    return {"params": ddp.full_state_dict(), "rules": rules, "step_calls": step_calls}


def _assert_equal(got: dict, reference: dict, what: str) -> None:
    assert set(got) == set(reference), what
    for name, ref in reference.items():
        assert torch.equal(got[name], ref), f"{what}: {name}"


def _assert_stats_only(step_calls, what: str) -> None:
    """Each step's only collective is the two-scalar gradient statistics all-reduce."""
    assert all(calls == [("all_reduce", 2)] for calls in step_calls), (what, step_calls)


def test_lion_bitwise_the_reference_at_dp_pp_and_tp():
    references = run_workers(
        1,
        _tasks,
        [
            (reference_worker, (LION, RUNS, 2)),
            (reference_worker, (LION, RUNS, 4)),
            (reference_worker, (LION, [(STEPS, 1)], 1)),
            (tp_reference_worker, (LION, STEPS)),
            (reference_worker, (MUON_LION, [(STEPS, 1)], 2)),
            (reference_worker, (OTHER_BETAS, [(STEPS, 1)], 2)),
            (reference_worker, ({}, [(STEPS, 1)], 2)),
        ],
    )[0]
    ref_dp2, ref_dp4, ref_pp, ref_tp, ref_muon_lion, ref_other_betas, ref_muon_adam = references
    world2 = run_workers(
        2,
        _tasks,
        [
            (train_worker, (LION, RUNS)),
            (train_worker, (LION, [(STEPS, 1)], 2)),
            (tp_step_worker, (LION, STEPS)),
            (_rules_worker, (MUON_LION, STEPS)),
        ],
    )
    dp2, _, tp2, muon_lion = world2[0]
    pp2 = {name: p for rank in world2 for name, p in rank[1][0]["params"].items()}  # both stages'
    rules = world2[0][3]["rules"] | world2[1][3]["rules"]
    dp4 = run_workers(4, _tasks, [(train_worker, (LION, RUNS))])[0][0]
    for world, runs, refs in (("DP2", dp2, ref_dp2), ("DP4", dp4, ref_dp4)):
        for (_, micro), run, ref in zip(RUNS, runs, refs):
            _assert_equal(run["params"], ref["params"], f"{world} x {micro} micro-batches")
            _assert_stats_only(run["step_calls"], f"{world} x {micro}")
    _assert_equal(pp2, ref_pp[0]["params"], "PP2")
    for rank in world2:
        _assert_stats_only(rank[1][0]["step_calls"], "PP2")
    _assert_equal(tp2["params"], ref_tp["params"], "TP2 (optimizer level)")
    _assert_stats_only(tp2["step_calls"], "TP2")
    # Negative control: other betas give other weights, so the comparisons above can fail.
    assert any(not torch.equal(ref_other_betas[0]["params"][n], p) for n, p in ref_dp2[0]["params"].items())
    # --optimizer muon --muon-scalar-optimizer lion: Muon on the hidden matrices, Lion on the rest, bitwise.
    _assert_equal(muon_lion["params"], ref_muon_lion[0]["params"], "muon + lion")
    _assert_stats_only(muon_lion["step_calls"], "muon + lion")
    assert {rule for _, rule in rules} == {"muon", "lion"}
    assert all((rule == "muon") == name.endswith(HIDDEN) for name, rule in rules)
    assert any(not torch.equal(ref_muon_adam[0]["params"][n], p) for n, p in muon_lion["params"].items())


def _tiny_flags(*extra: str) -> list[str]:
    """tests/launch.py's TINY without its --optimizer, plus ``extra``."""
    from tests.launch import TINY

    at = TINY.index("--optimizer")
    return [*TINY[:at], *TINY[at + 2 :], "--eval-iters", "0", *extra]


def test_optimizer_lion_through_the_command_line(tmp_path):
    """pretrain_gpt.py's flags: --optimizer lion with --use-matrix-fsdp trains (the loss falls over 5
    iterations); without it megatron-core 0.16.1's optimizer factory has no 'lion', so training/setup.py runs
    our rule on the replicated backend: the same losses (within 1e-6). --optimizer muon
    --muon-scalar-optimizer lion trains too, to other losses than Muon with AdamW."""
    from tests.launch import pretrain_in_workers, train_losses

    def losses(*extra):
        return train_losses(pretrain_in_workers(2, *_tiny_flags(*extra), tmp_path=tmp_path))

    fsdp = losses("--use-matrix-fsdp", "--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99")
    replicated = losses("--optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99")
    assert len(fsdp) == 5 and fsdp[-1] < fsdp[0] - 0.1, fsdp
    assert max(abs(a - b) for a, b in zip(fsdp, replicated)) < 1e-6, (fsdp, replicated)
    muon_lion = losses("--use-matrix-fsdp", "--optimizer", "muon", "--muon-scalar-optimizer", "lion")
    muon_adam = losses("--use-matrix-fsdp", "--optimizer", "muon")
    assert muon_lion[-1] < muon_lion[0] - 0.1 and muon_lion[2:] != muon_adam[2:], (muon_lion, muon_adam)
