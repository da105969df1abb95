"""--mfsdp-layout even (ordinary ZeRO-3 even shards, reconstruction Muon) at DP=2: the same numbers
as the owner layout and the single-process reference, and a step that gathers every matrix while the
owner layout's moves no tensor."""

import pytest
import torch

from megatron_mfsdp.testing import (
    assemble_optimizer_state,
    count_collectives,
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    reference_train,
    run_workers,
    tiny_gpt,
)

STEPS = 3
MICRO = 2


def _train_worker(rank, world_size, layout, steps, num_micro):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer

    init_megatron()
    config, model = tiny_gpt()
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout), model)
    opt = get_megatron_optimizer(optimizer_config(), [ddp])
    step_calls = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        for k in range(num_micro):
            lm_loss(ddp, micro_batch(step, k, rank), num_micro).backward()
        ddp.finish_grad_sync()
        with count_collectives() as calls:
            success, _, _ = opt.step()
        assert success
        step_calls.append(list(calls))
    return {
        "full": ddp.full_state_dict(),
        "opt": opt.state_dict(),
        "step_calls": step_calls,
        "rules": sorted({(o.rule, "slice" if o.master.dim() == 1 else "whole") for _, o in opt._pieces()}),
        "segments": [u.layout.segment_numel(rank) for u in ddp.units],
        "matrix_numel": [u.layout.matrix_numel for u in ddp.units],
        "shapes": {s.name: s.shape for u in ddp.plan.units for s in u.slots},
        "bytes": {**ddp.local_bytes(), **opt.local_bytes()},
    }


def _reference_worker(rank, world_size, dp_size, steps, num_micro):
    init_megatron()
    config, model = tiny_gpt()
    return reference_train(model, config, optimizer_config(), dp_size, steps, num_micro)


def _full_state(results):
    return assemble_optimizer_state([r["opt"] for r in results], results[0]["shapes"])


def test_dp2_even_layout_equals_owner_layout_and_reference():
    even = run_workers(2, _train_worker, "even", STEPS, MICRO)
    owner = run_workers(2, _train_worker, "owner", STEPS, MICRO)
    reference = run_workers(1, _reference_worker, 2, STEPS, MICRO)[0]
    # Bitwise: the gradient sums are the same rank-order sums, momentum is elementwise on the slice,
    # and Newton-Schulz runs on the same full matrix with the same kernels (fp32, CPU).
    for name, ref in reference["params"].items():
        assert torch.equal(even[0]["full"][name], ref), f"{name}: even differs from the reference"
        assert torch.equal(even[0]["full"][name], owner[0]["full"][name]), f"{name}: even differs from owner"
    even_state, owner_state = _full_state(even), _full_state(owner)
    for name, st in reference["state"].items():
        for key, ref in st.items():
            assert torch.equal(even_state[name][key], ref), f"{name}.{key}: even differs from the reference"
            assert torch.equal(even_state[name][key], owner_state[name][key])

    for rank in range(2):
        # even: every parameter is an even slice (no matrix region), segments within one element
        assert even[rank]["rules"] == [("adamw", "slice"), ("muon_even", "slice")]
        assert all(n == 0 for n in even[rank]["matrix_numel"])
        # owner: the step's only collective is the 2-scalar grad-stats all-reduce
        assert all(calls == [("all_reduce", 2)] for calls in owner[rank]["step_calls"])
        # even: that all-reduce plus one all_to_all_single per hidden matrix (2 layers x 4)
        for calls in even[rank]["step_calls"]:
            assert calls[0] == ("all_reduce", 2)
            assert [c[0] for c in calls[1:]] == ["all_to_all_single"] * 8
    for a, b in zip(even[0]["segments"], even[1]["segments"]):
        assert abs(a - b) <= 1
    # The same optimizer state in total: momentum and moments cover every element once.
    states = [sum(r["bytes"]["optimizer_state"] for r in run) for run in (even, owner)]
    assert states[0] == states[1]


def test_even_rule_set_and_bounds():
    """The rule set of layout 'even' sends the hidden matrices to muon_even (SLICE), leaves the tail to
    adamw, and a matrix's per-rank bounds follow the even tail split (rank order, covering it once)."""
    from megatron_mfsdp.models.gpt import gpt_param_roles
    from megatron_mfsdp.optim import registry
    from megatron_mfsdp.placement import ParamSpec, UnitSpec, plan_units

    rules = registry.rule_set((), optimizer_config(), "even").extended(gpt_param_roles())
    assert rules.classify("decoder.layers.0.mlp.linear_fc1.weight", (128, 64)) == "matrix"
    assert rules.storage("matrix") == "slice" and rules.storage("muon") == "slice"
    assert registry.rule_for("matrix", "slice", optimizer_config()).name == "muon_even"
    assert registry.rule_for("matrix", "whole", optimizer_config()).name == "muon"
    assert rules.classify("decoder.layers.0.mlp.linear_fc1.bias", (128,)) == "elementwise"
    assert registry.rule_for("elementwise", "slice", optimizer_config()).name == "adamw"
    assert rules.update_rule("matrix") == "muon_even" and rules.update_rule("elementwise") == "adamw"
    owner = registry.rule_set((), optimizer_config()).extended(gpt_param_roles())
    assert owner.classify("x.linear_fc1.weight", (4, 4)) == "matrix" and owner.storage("matrix") == "whole"
    with pytest.raises(ValueError, match="--mfsdp-layout"):
        registry.rule_set([], optimizer_config(), "zero3")
    specs = [ParamSpec("a", (5, 7), "muon_even", "slice"), ParamSpec("b", (3,), "adamw", "slice")]
    layout = plan_units([UnitSpec("u", specs)], 3).units[0]
    assert layout.tail_bounds == [0, 13, 26, 38]
    assert layout.param_bounds(layout.slots[0]) == [0, 13, 26, 35]
    assert layout.param_bounds(layout.slots[1]) == [0, 0, 0, 3]
    owner = plan_units([UnitSpec("u", [ParamSpec("a", (5, 7), "muon", "whole", cost=1)])], 3).units[0]
    r = owner.slots[0].owner
    assert owner.param_bounds(owner.slots[0]) == [0] + [0 if k < r else 35 for k in range(3)]


def test_mfsdp_layout_flag(capsys):
    """--mfsdp-layout reaches MatrixFSDPConfig; 'even' without --use-matrix-fsdp or with TP is refused."""
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.setup import runtime_config
    from tests.launch import TINY

    assert runtime_config(parse_args([*TINY, "--use-matrix-fsdp"], world_size=2)).layout == "owner"
    args = parse_args([*TINY, "--use-matrix-fsdp", "--mfsdp-layout", "even"], world_size=2)
    assert runtime_config(args).layout == "even"
    refused = (
        ([], "needs --use-matrix-fsdp"),
        (["--use-matrix-fsdp", "--tensor-model-parallel-size", "2"], "supports --tensor-model-parallel-size 1 only"),
    )
    for extra, why in refused:
        with pytest.raises(SystemExit):
            parse_args([*TINY, *extra, "--mfsdp-layout", "even"], world_size=2)
        assert f"--mfsdp-layout even {why}" in capsys.readouterr().err
