"""A whole-matrix rule added from outside the package (tests/toy_rule.py: one file, one
``registry.register``) trains on owner placement: it runs on every hidden matrix and nowhere else,
the planner costs the matrices with its cost, its step has no collective on tensor data, DP 2
equals the single-process reference bitwise, and its state of any shape (an n x n factor, a
scalar) is saved whole under its matrix's name and read back at DP 1 and 4."""

import torch

from megatron_mfsdp.testing import (
    dist_checkpoint,
    init_megatron,
    optimizer_config,
    reference_train,
    run_workers,
    tiny_gpt,
)
from megatron_mfsdp.testing.exactness import tiny_dp_run

STEPS = 2
HIDDEN = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


def _toy_config():
    from tests import toy_rule

    toy_rule.register()
    return optimizer_config(optimizer="toy")


def _worker(rank, world_size, path, steps):
    from tests import toy_rule

    ddp, opt, step_calls = tiny_dp_run(rank, _toy_config(), steps)
    if path is not None:
        dist_checkpoint(ddp, opt, path, save=bool(steps))
    toy = {o.global_name: {k: v.clone() for k, v in o.state.items()} for _, o in opt._pieces() if o.rule == "toy"}
    return {
        "weights": ddp.full_state_dict(),
        "toy_state": toy,
        "rules": sorted({o.rule for _, o in opt._pieces()}),
        "calls": list(toy_rule.CALLS),
        "step_calls": step_calls,
        "planned_cost": sum(ddp.plan.cost_per_rank),
        "matrices": {s.name: s.shape for u in ddp.plan.units for s in u.slots if s.storage == "whole"},
    }


def _reference_worker(rank, world_size, dp, steps):
    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    return reference_train(model, config, _toy_config(), dp, steps, 1)


def test_toy_rule_runs_on_every_matrix_planned_by_its_cost_bitwise_the_reference():
    from tests import toy_rule

    runs = run_workers(2, _worker, None, STEPS)
    reference = run_workers(1, _reference_worker, 2, STEPS)[0]
    matrices = runs[0]["matrices"]
    assert matrices and all(name.endswith(HIDDEN) for name in matrices)  # every hidden matrix, nothing else
    # Its calls: each hidden matrix once per step, on its owner, with the matrix's whole shape.
    called = sorted(shape for r in runs for shape in r["calls"])
    assert called == sorted([tuple(s) for s in matrices.values()] * STEPS)
    assert all(len(r["calls"]) > 0 for r in runs)  # both ranks own some
    assert all(r["rules"] == ["adamw", "toy"] for r in runs)  # toy on matrices, AdamW on the rest
    # The planner costed the matrices by the toy's cost, not Muon's.
    assert runs[0]["planned_cost"] == sum(toy_rule.cost(s, None, None) for s in matrices.values())
    # The step's only collective is the two-scalar gradient-statistics all-reduce.
    for r in runs:
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]
    for name, ref in reference["params"].items():
        assert torch.equal(runs[0]["weights"][name], ref), name
    # Negative control: the toy's update is not Muon's, so the comparison above can fail.
    muon = run_workers(1, _muon_reference_worker, 2, STEPS)[0]
    assert any(not torch.equal(muon["params"][n], reference["params"][n]) for n in reference["params"])


def _muon_reference_worker(rank, world_size, dp, steps):
    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    return reference_train(model, config, optimizer_config(), dp, steps, 1)


def test_toy_state_of_any_shape_is_saved_whole_and_read_at_dp1_and_dp4(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_workers(2, _worker, path, STEPS)
    expected = {n: st for r in saved for n, st in r["toy_state"].items()}
    shapes = saved[0]["matrices"]
    for name, st in expected.items():  # n x n factors, not shaped like their parameter
        cols = shapes[name][1]  # one stage: global names are the chunk's names
        assert tuple(st["gram"].shape) == (cols, cols) and st["count"].dim() == 0, name
    assert all(int(st["count"]) == STEPS for st in expected.values())
    for world_size in (1, 4):
        loaded = run_workers(world_size, _worker, path, 0)
        got = {n: st for r in loaded for n, st in r["toy_state"].items()}
        assert set(got) == set(expected), world_size
        for name, state in expected.items():
            for key, tensor in state.items():
                assert torch.equal(got[name][key], tensor), f"DP={world_size}: {name}.{key}"
        for name, tensor in saved[0]["weights"].items():
            assert torch.equal(loaded[0]["weights"][name], tensor), f"DP={world_size}: {name}"
