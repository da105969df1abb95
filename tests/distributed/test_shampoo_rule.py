"""``--optimizer shampoo`` held to the single-process reference (megatron_mfsdp/testing/exactness.py) at DP 2
and 4 (1 and 4 micro-batches), PP 2 and TP 2 (``duplicated``, at the optimizer), all bitwise, with the
owner step's only collective the two-scalar gradient-statistics all-reduce; and ``--mfsdp-layout even``
bitwise the owner layout at DP 2. A precondition frequency of 2 puts the first roots at step 2 (step 1 is
Adam's direction), keeps them at step 3 and recomputes them at step 4. Through the command line it trains
with and without --use-matrix-fsdp (the replicated backend runs the same rule on every rank)."""

import pytest
import torch

from megatron_mfsdp.optim import shampoo
from megatron_mfsdp.optim.rule import CostContext
from megatron_mfsdp.optim.shampoo import ShampooSettings
from megatron_mfsdp.testing import (
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    run_workers,
    tiny_gpt,
)
from megatron_mfsdp.testing.exactness import (
    reference_worker,
    tp_reference_worker,
    tp_step_worker,
    train_worker,
)
from tests.launch import TINY, pretrain_in_workers, train_losses

STEPS = 4
RUNS = [(STEPS, 1), (STEPS, 4)]
GRAD_STATS = [("all_reduce", 2)]


def _overrides(**settings) -> dict:
    return {
        "optimizer": "shampoo",
        "rule_settings": {"shampoo": ShampooSettings(shampoo_precondition_frequency=2, **settings)},
    }


def _layout_run(rank, layout: str, steps: int, num_micro: int) -> dict:
    """The tiny GPT trained at DP = world in ``layout``: full weights, rules, each matrix's whole state."""
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from megatron_mfsdp.optim import registry

    cfg = optimizer_config(**_overrides())
    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout, rules=registry.rule_set((), cfg, layout)), model)
    opt = get_megatron_optimizer(cfg, [ddp])
    for step in range(1, steps + 1):
        opt.zero_grad()
        for k in range(num_micro):
            lm_loss(ddp, micro_batch(step, k, rank), num_micro).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
    pieces = list(opt.owned_pieces())
    return {
        "planned": (
            sum(ddp.plan.cost_per_rank),
            [s.shape for u in ddp.plan.units for s in u.slots if s.storage == "whole"],
        ),
        "full": ddp.full_state_dict(),
        "rules": sorted({p.rule for p in pieces}),
        "state": {p.global_name: {k: v.clone() for k, v in p.state.items()} for p in pieces if "left_0" in p.state},
    }


def _dp2_worker(rank, world_size):
    """One process start for everything at DP 2: the exactness.py runs and both layouts."""
    layouts = {layout: _layout_run(rank, layout, STEPS, 2) for layout in ("owner", "even")}
    return {"runs": train_worker(rank, world_size, _overrides(), RUNS), "layouts": layouts}


def _reference_runs(rank, world_size):
    """The single-process references: DP 2 and 4 (both micro-batch counts), PP 2's (DP 1) and TP's."""
    return {
        "dp2": reference_worker(rank, world_size, _overrides(), RUNS, 2),
        "dp4": reference_worker(rank, world_size, _overrides(), RUNS, 4),
        "pp2": reference_worker(rank, world_size, _overrides(), [(STEPS, 1)], 1)[0],
        "tp": tp_reference_worker(rank, world_size, _overrides(tp_mode="duplicated"), STEPS),
    }


def _assert_bitwise(run: dict, reference: dict, label: str) -> None:
    assert run["params"], label
    for name, tensor in run["params"].items():
        assert torch.equal(tensor, reference["params"][name]), f"{label}: {name}"


def _assert_state(states: list[dict], reference: dict, label: str) -> None:
    """Every owner's Shampoo state (factors, roots, moments) equals the reference's, roots computed."""
    for state in states:
        for name, st in state.items():
            for key, tensor in st.items():
                assert torch.equal(tensor.reshape(-1), reference["state"][name][key].reshape(-1)), (
                    f"{label}: {name}.{key}"
                )
    roots = [st["left_root_0"] for state in states for st in state.values() if "left_root_0" in st]
    assert roots and all(r.any() for r in roots), label


def test_shampoo_dp_pp_tp_bitwise_the_reference_and_even_equals_owner():
    reference = run_workers(1, _reference_runs)[0]
    dp2 = run_workers(2, _dp2_worker)
    dp4 = run_workers(4, train_worker, _overrides(), RUNS)
    for world, results, ref in ((2, [r["runs"] for r in dp2], reference["dp2"]), (4, dp4, reference["dp4"])):
        for i, (steps, micro) in enumerate(RUNS):
            label = f"DP{world} x {micro} micro-batches"
            _assert_bitwise(results[0][i], ref[i], label)
            _assert_state([r[i]["state"] for r in results], ref[i], label)
            for r in results:  # zero tensor collectives in the step
                assert r[i]["step_calls"] == [GRAD_STATS] * steps, (label, r[i]["step_calls"])
    _check_pp2(reference["pp2"])
    _check_tp2(reference["tp"])
    _check_even(dp2)


def _check_pp2(reference: dict) -> None:
    stages = run_workers(2, train_worker, _overrides(), [(STEPS, 1)], 2)
    assert set(stages[0][0]["params"]) | set(stages[1][0]["params"]) == set(reference["params"])
    for stage in stages:
        _assert_bitwise(stage[0], reference, "PP2")
        assert stage[0]["step_calls"] == [GRAD_STATS] * STEPS, stage[0]["step_calls"]
    _assert_state([s[0]["state"] for s in stages], reference, "PP2")


def _check_tp2(reference: dict) -> None:
    """duplicated: each TP-split matrix's gradient all-gathered over TP (TP 2 x DP 1: a DP collective would
    be over one rank and is not made), one all_gather_single of the whole matrix per matrix."""
    ranks = run_workers(2, tp_step_worker, _overrides(tp_mode="duplicated"), STEPS)
    _assert_bitwise(ranks[0], reference, "TP2 duplicated")
    _assert_state([ranks[0]["state"]], reference, "TP2 duplicated")
    matrices = [n for n, t in reference["params"].items() if t.dim() == 2 and "left_0" in reference["state"][n]]
    whole = sorted(reference["params"][n].numel() for n in matrices)
    for r in ranks:
        for calls in r["step_calls"]:
            assert calls[0] == GRAD_STATS[0], calls
            gathers = calls[1:]
            assert {c[0] for c in gathers} == {"all_gather_single"}, calls
            assert sorted(c[1] for c in gathers) == [n + n // 2 for n in whole], calls  # counted: out + in


def _check_even(dp2: list[dict]) -> None:
    owner = [r["layouts"]["owner"] for r in dp2]
    even = [r["layouts"]["even"] for r in dp2]
    planned, shapes = owner[0]["planned"]  # the planner costs the owner's matrices by Shampoo's cost
    context = CostContext(optimizer_config(**_overrides()))
    assert len(shapes) == 8 and planned == sum(shampoo.cost(tuple(s), None, context) for s in shapes)
    assert all(r["rules"] == ["adamw", "shampoo"] for r in owner)
    assert all(r["rules"] == ["adamw", "shampoo_even"] for r in even)
    for name, tensor in owner[0]["full"].items():
        assert torch.equal(even[0]["full"][name], tensor), f"even differs from owner: {name}"
    owner_state = {n: st for r in owner for n, st in r["state"].items()}
    for r in even:  # each holder of a slice keeps the whole matrix's state, the owner's bitwise
        for name, st in r["state"].items():
            for key, tensor in st.items():
                assert torch.equal(tensor, owner_state[name][key]), f"even state: {name}.{key}"
    assert owner_state and all(any(n in r["state"] for r in even) for n in owner_state)


def test_command_line_trains_with_and_without_use_matrix_fsdp(tmp_path):
    """pretrain_gpt.py's path at DP 2, 8 iterations: the loss falls; without --use-matrix-fsdp the replicated
    backend gives the same losses (measured equal; asserted to 1e-6); with --use-distributed-optimizer and no
    --use-matrix-fsdp it is refused at the flags (validate.py: validate_optimizer), naming them."""
    flags = [*TINY, "--optimizer", "shampoo", "--shampoo-precondition-frequency", "2", "--train-iters", "8"]
    flags += ["--eval-interval", "8"]
    owner = train_losses(pretrain_in_workers(2, *flags, "--use-matrix-fsdp", tmp_path=tmp_path / "owner"))
    replicated = train_losses(pretrain_in_workers(2, *flags, tmp_path=tmp_path / "replicated"))
    assert len(owner) == 8 and owner[-1] < owner[0] - 0.5, owner
    assert replicated == pytest.approx(owner, abs=1e-6, rel=0)
    with pytest.raises(
        Exception, match="--optimizer shampoo with --use-distributed-optimizer .* needs --use-matrix-fsdp"
    ):
        pretrain_in_workers(2, *flags, "--use-distributed-optimizer", tmp_path=tmp_path / "refused")
