"""--optimizer soap as a MatrixFSDP rule (megatron_mfsdp/optim/soap.py) against the single-process
reference (megatron_mfsdp/testing/exactness.py): DP 2 and 4 with 1 and 4 micro-batches and PP 2 bitwise,
each owner-layout step moving no tensor (its only collective is the two-scalar gradient-statistics
all-reduce); TP 2 ``duplicated`` bitwise TP 1 at the optimizer; TP 2 ``blockwise`` on the TP-local
shards with no collective; ``--mfsdp-layout even`` bitwise the owner layout. Then the command line."""

import pytest
import torch

from megatron_mfsdp.optim.soap import SoapSettings
from megatron_mfsdp.testing import (
    optimizer_config,
    run_workers,
)
from megatron_mfsdp.testing.exactness import (
    reference_worker,
    tiny_dp_run,
    tp_reference_worker,
    tp_step_worker,
    train_worker,
)

STEPS = 3  # step 1 eigh, steps 2 and 3 QR refreshes
RUNS = [(STEPS, 1), (STEPS, 4)]  # (steps, micro-batches)
SOAP = {"optimizer": "soap"}
DUPLICATED = {"optimizer": "soap", "rule_settings": {"soap": SoapSettings(tp_mode="duplicated")}}
HIDDEN = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
STATS = [("all_reduce", 2)]  # the gradient statistics: the owner layout's only collective in a step


def _references(rank, world_size):
    return {
        "dp2": reference_worker(rank, world_size, SOAP, RUNS, 2),
        "dp4": reference_worker(rank, world_size, SOAP, RUNS, 4),
        "dp1": reference_worker(rank, world_size, SOAP, [(STEPS, 1)], 1),
        "muon": reference_worker(rank, world_size, {}, [(STEPS, 1)], 2),
        "tp": tp_reference_worker(rank, world_size, DUPLICATED, STEPS),
    }


def _even_worker(rank, world_size, steps):
    """--mfsdp-layout even: every matrix an even slice, its gradient gathered over DP for the step."""
    ddp, opt, step_calls = tiny_dp_run(rank, optimizer_config(**SOAP), steps, layout="even")
    rules = sorted({(o.rule, o.master.dim()) for _, o in opt._pieces()})
    return {"params": ddp.full_state_dict(), "step_calls": step_calls, "rules": rules}


def _world2(rank, world_size):
    return {
        "dp": train_worker(rank, world_size, SOAP, RUNS),
        "even": _even_worker(rank, world_size, STEPS),
        "pp": train_worker(rank, world_size, SOAP, [(STEPS, 1)], pp=2),
        "duplicated": tp_step_worker(rank, world_size, DUPLICATED, STEPS),
        "blockwise": tp_step_worker(rank, world_size, SOAP, STEPS),
    }


@pytest.fixture(scope="module")
def runs():
    """Every run of this file: one run_workers per world size."""
    return {
        "ref": run_workers(1, _references)[0],
        2: run_workers(2, _world2),
        4: run_workers(4, train_worker, SOAP, RUNS),
    }


def _assert_equal(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), what
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), f"{what}: {name}"


def test_dp2_dp4_bitwise_the_reference_with_no_tensor_collective(runs):
    for world, key in ((2, "dp2"), (4, "dp4")):
        for run, (_, micro) in enumerate(RUNS):
            what = f"DP{world} x {micro} micro-batches"
            reference = runs["ref"][key][run]
            results = [r[run] for r in runs[4]] if world == 4 else [r["dp"][run] for r in runs[2]]
            _assert_equal(results[0]["params"], reference["params"], what)
            owned = {name: st for r in results for name, st in r["state"].items()}
            assert set(owned) == {n for n in reference["params"] if n.endswith(HIDDEN)}, what
            for name, state in owned.items():  # factors, bases and moments, bitwise
                for k, v in state.items():
                    assert torch.equal(v.reshape(-1), reference["state"][name][k]), f"{what}: {name}.{k}"
            assert all(calls == STATS for r in results for calls in r["step_calls"]), what
    # Negative control: SOAP's numbers are not Muon's, so the comparison above can fail.
    muon, soap = runs["ref"]["muon"][0]["params"], runs["ref"]["dp2"][0]["params"]
    assert any(not torch.equal(muon[n], soap[n]) for n in soap if n.endswith(HIDDEN))


def test_pp2_bitwise_the_reference(runs):
    reference = runs["ref"]["dp1"][0]["params"]
    stages = [r["pp"][0] for r in runs[2]]
    _assert_equal({**stages[0]["params"], **stages[1]["params"]}, reference, "PP2")
    assert all(calls == STATS for s in stages for calls in s["step_calls"])


def test_tp2_duplicated_bitwise_tp1_at_the_optimizer(runs):
    """duplicated: each TP-split matrix's gradient all-gathered over TP, the whole matrix's SOAP on both
    ranks (its factors of the whole matrix), the local slice applied: TP 1's numbers."""
    reference = runs["ref"]["tp"]
    ranks = [r["duplicated"] for r in runs[2]]
    _assert_equal(ranks[0]["params"], reference["params"], "TP2 duplicated")
    for name, state in ranks[0]["state"].items():
        rows, cols = reference["params"][name].shape
        assert state["Q_L"].shape == (rows, rows) and state["Q_R"].shape == (cols, cols), name
        for k, v in state.items():
            assert torch.equal(v, reference["state"][name][k]), f"{name}.{k}"
    # Besides the statistics, one all-gather over TP (the whole group here: DP 1) per hidden matrix,
    # its (in + out) elements 3x the local shard's.
    shards = sorted(3 * p.numel() // 2 for n, p in reference["params"].items() if n.endswith(HIDDEN))
    for r in ranks:
        for calls in r["step_calls"]:
            assert calls[0] == STATS[0] and {c.name for c in calls[1:]} == {"all_gather_single"}, calls
            assert sorted(c[1] for c in calls[1:]) == shards


def test_tp2_blockwise_steps_the_local_shards_with_no_collective(runs):
    """blockwise (the default; Megatron-LM's SOAP on the TP-local shard): factors of the shard, no
    collective in the step besides the statistics, numbers of their own (not TP 1's)."""
    reference = runs["ref"]["tp"]
    ranks = [r["blockwise"] for r in runs[2]]
    for r in ranks:
        assert all(calls == STATS for calls in r["step_calls"]), r["step_calls"]
    for name, state in ranks[0]["state"].items():
        rows, cols = reference["params"][name].shape
        local = (rows // 2, cols) if name.endswith(("linear_qkv.weight", "linear_fc1.weight")) else (rows, cols // 2)
        assert state["Q_L"].shape == (local[0],) * 2 and state["Q_R"].shape == (local[1],) * 2, name
    params = ranks[0]["params"]
    assert all(torch.isfinite(t).all() for t in params.values())
    assert any(not torch.equal(params[n], reference["params"][n]) for n in params if n.endswith(HIDDEN))


def test_even_layout_bitwise_the_owner_layout_at_dp2(runs):
    """--mfsdp-layout even (the reconstruction baseline): each matrix's gradient gathered over DP, the
    same SOAP on the whole matrix on every holder: the owner layout's numbers, with 8 gathers a step."""
    owner = runs[2][0]["dp"][0]
    for r in runs[2]:
        even = r["even"]
        assert even["rules"] == [("adamw", 1), ("soap_even", 1)]
        _assert_equal(even["params"], owner["params"], "even vs owner")
        for calls in even["step_calls"]:
            assert calls[0] == STATS[0] and len(calls) == 1 + len(HIDDEN) * 2, calls


CLI = ["--optimizer", "soap", "--train-iters", "3", "--eval-iters", "0"]


def test_soap_flags_reach_the_rule_settings():
    """Each SoapSettings field is a flag of pretrain_gpt.py, its value in the optimizer config."""
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.setup import optimizer_config as config_of_args
    from tests.launch import TINY

    flags = [
        *("--soap-shampoo-beta", "0.9", "--no-soap-use-kl-shampoo", "--soap-precondition-frequency", "3"),
        *("--soap-max-precond-dim", "100", "--soap-tp-mode", "duplicated", "--soap-basis", "previous"),
    ]
    settings = config_of_args(parse_args([*TINY, *CLI, "--use-matrix-fsdp", *flags], world_size=2)).rule_settings
    assert settings["soap"] == SoapSettings(0.9, False, 3, 100, "duplicated", "previous")
    others = [s for name, s in settings.items() if name != "soap" and hasattr(s, "tp_mode")]
    assert all(s.tp_mode == type(s)().tp_mode for s in others)  # --soap-tp-mode is SOAP's alone
    default = config_of_args(parse_args([*TINY, *CLI, "--use-matrix-fsdp"], world_size=2))
    assert default.rule_settings["soap"] == SoapSettings() and default.optimizer == "soap"


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--use-distributed-optimizer"], "--optimizer soap with --use-distributed-optimizer or"),
        (
            ["--use-matrix-fsdp", "--mfsdp-split-qkv-owners", "contiguous"],
            "--optimizer soap updates a linear_qkv whole",
        ),
        (["--use-matrix-fsdp", "--soap-shampoo-beta", "1"], "--soap-shampoo-beta must be in [0, 1)"),
        (["--use-matrix-fsdp", "--soap-basis", "paper"], "--soap-basis: invalid choice"),
    ],
)
def test_soap_refusals_name_the_flag(flags, message, capsys):
    """Refused while parsing, before any work: Megatron's DistributedOptimizer cannot hold whole
    matrices (needs --use-matrix-fsdp), Q, K and V owners apart need a rule that splits them."""
    from megatron_mfsdp.training.arguments import parse_args
    from tests.launch import TINY

    with pytest.raises(SystemExit):
        parse_args([*TINY, *CLI, *flags], world_size=2)
    assert message in capsys.readouterr().err


def test_pretrain_soap_owner_replicated_and_fp8(tmp_path):
    """pretrain_gpt.py with --optimizer soap: on MatrixFSDP owners; without --use-matrix-fsdp (plain
    DDP: the replicated backend, every rank stepping every matrix) the same losses; with FP8 weights
    gathered from their owners (bf16, hybrid) three iterations whose losses FP8 moved."""
    from tests.launch import TINY, pretrain_in_workers, train_losses

    def losses(name, *flags):
        return train_losses(pretrain_in_workers(2, *TINY, *CLI, *flags, tmp_path=tmp_path / name))

    owner = losses("owner", "--use-matrix-fsdp")
    assert len(owner) == 3 and owner[-1] < owner[0]
    assert losses("replicated") == owner  # measured equal (two-rank sums commute)
    bf16 = losses("bf16", "--use-matrix-fsdp", "--bf16")
    fp8 = losses("fp8", "--use-matrix-fsdp", "--bf16", "--fp8-format", "hybrid", "--fp8-param-gather")
    assert len(fp8) == 3 and all(abs(a - b) < 0.1 for a, b in zip(fp8, bf16)) and fp8 != bf16
