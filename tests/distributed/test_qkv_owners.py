"""--mfsdp-split-qkv-owners: the Q, K and V blocks of each linear_qkv on owners of their own
(placement/blocks.py), as one row range each (contiguous, one query group) or as their rows of
every group (all, here MHA: four groups). Training equals the single-process reference bitwise (the merged weight
is the same numbers; each block is stepped as the split step steps it), the optimizer step still
moves no tensor data, the traffic stays ZeRO-3's, and a checkpoint saved with the blocks apart
loads into the whole-owner layout (and back) bitwise, under megatron-core's keys."""

import pytest
import torch

from megatron_mfsdp.testing import (
    assemble_optimizer_state,
    count_collectives,
    dist_checkpoint,
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    reference_train,
    run_workers,
    tiny_gpt,
)

STEPS = 3
MQA = {"num_query_groups": 1}  # one query group per TP shard at TP=1: Q, K, V are row ranges
MHA = {"num_query_groups": 4}  # a group per head: Q, K and V interleave, a block is 4 row ranges


def _train_worker(rank, world_size, steps, mode, model_overrides, order="rank"):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer

    init_megatron()
    config, model = tiny_gpt(**model_overrides)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=mode, reduce_order=order), model)
    opt = get_megatron_optimizer(optimizer_config(), [ddp])
    step_calls = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        lm_loss(ddp, micro_batch(step, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        with count_collectives() as calls:
            success, _, _ = opt.step()
        assert success
        step_calls.append(list(calls))
    moved = {phase: tuple(link) for phase, link in ddp.comm.traffic.items()}
    return {
        "full": ddp.full_state_dict(),
        "opt": opt.state_dict(),
        "step_calls": step_calls,
        "slots": [(s.name, s.param_name, s.owner, s.shape) for u in ddp.plan.units for s in u.slots],
        "runs": _block_runs(ddp),
        "shapes": {n: s for u in ddp.units for n, s in u.shapes.items()},
        "traffic": ddp.traffic_per_iteration(1),
        "report": ddp.plan.report(),
        "moved": moved,
    }


def _block_runs(ddp) -> dict:
    """Optimizer key -> ParamSlot.runs() of each block (how assemble_optimizer_state places it)."""
    return {
        f"{ddp.global_names[s.param]}@{s.param_start}": s.runs() for u in ddp.plan.units for s in u.slots if s.param
    }


def _reference_worker(rank, world_size, dp_size, steps, model_overrides):
    init_megatron()
    config, model = tiny_gpt(**model_overrides)
    return reference_train(model, config, optimizer_config(), dp_size, steps, 1)


# A block's gradient rows are packed at its place in the unit's flat buffer, whichever order sums them.
@pytest.mark.parametrize("mode,model", [("contiguous", MQA), ("all", MHA)])
def test_qkv_blocks_apart_bitwise_equal_single_process_and_communication_free(mode, model):
    results = run_workers(2, _train_worker, STEPS, mode, model)
    reference = run_workers(1, _reference_worker, 2, STEPS, model)[0]

    blocks = [s for s in results[0]["slots"] if s[0] != s[1]]
    assert sorted(name[-3:] for name, *_ in blocks) == ["[k]", "[k]", "[q]", "[q]", "[v]", "[v]"]
    owners = {}
    for _name, param, owner, _shape in blocks:
        owners.setdefault(param, set()).add(owner)
    # The merge after the gather and the split before the reduction are exercised: some linear_qkv
    # has its blocks on both ranks (so a wrong block order could not go unseen below).
    assert any(len(o) == 2 for o in owners.values()), owners

    for name, ref in reference["params"].items():
        got = results[0]["full"][name]
        assert torch.equal(got, ref), f"{name} differs by {(got - ref).abs().max().item():.3e}"
    state = assemble_optimizer_state([r["opt"] for r in results], results[0]["shapes"], results[0]["runs"])
    assert {run[3] for run in results[0]["runs"].values()} == {model["num_query_groups"]}  # runs per block
    for name, st in reference["state"].items():
        for key, ref in st.items():
            assert not torch.isnan(state[name][key]).any(), f"{name}.{key}: a block left uncovered"
            assert torch.equal(state[name][key], ref), f"{name}.{key} differs"

    assert "Q/K/V apart in 2 linear_qkv" in results[0]["report"].splitlines()[0]
    for r in results:
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"]), r["step_calls"]
    # The blocks change owners, not traffic: no rank moved more than the predicted busiest rank of
    # each call, which is at most W / (W - 1) x 1.02 of ZeRO-3's bytes per rank.
    for phase, key in (("forward gather", "forward"), ("backward gather", "backward"), ("reduction", "reduce")):
        ours, zero3 = results[0]["traffic"][phase]
        assert 0 < ours <= 2 * 1.02 * zero3, (phase, ours, zero3)
        assert all(0 < max(r["moved"][key]) <= STEPS * ours for r in results), (phase, ours)


def test_qkv_blocks_apart_in_ring_order_within_rounding_of_rank_order():
    """NCCL's default order sums the blocks' rows in the ring's order: the same training within
    rounding (3 steps of Muon on the tiny model: 1e-6 relative)."""
    ring = run_workers(2, _train_worker, STEPS, "contiguous", MQA, "ring")
    exact = run_workers(2, _train_worker, STEPS, "contiguous", MQA, "rank")
    for name, want in exact[0]["full"].items():
        assert torch.allclose(ring[0]["full"][name], want, rtol=1e-6, atol=1e-7), name


def test_blocks_apart_place_finer_items_than_whole_matrices():
    """The same model planned both ways: blocks are items of their own, Q of (heads x head dim) rows,
    K and V of one head's rows, and every parameter's elements are placed exactly once."""
    whole = run_workers(1, _plan_worker, "whole")[0]
    apart = run_workers(1, _plan_worker, "contiguous")[0]
    qkv = [s for s in whole if s[0].endswith("linear_qkv.weight")]
    assert qkv and all(s[0] == s[1] for s in whole)
    for name, _, _, (rows, cols) in qkv:
        parts = {s[0][-2]: s[3] for s in apart if s[1] == name and s[0] != name}
        head_dim = rows // 6  # 4 query heads + 1 key + 1 value head
        assert parts == {"q": (4 * head_dim, cols), "k": (head_dim, cols), "v": (head_dim, cols)}, parts
    assert sum(torch.Size(s[3]).numel() for s in apart) == sum(torch.Size(s[3]).numel() for s in whole)


def _plan_worker(rank, world_size, mode):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron()
    config, model = tiny_gpt(**MQA)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=mode), model)
    return [(s.name, s.param_name, s.owner, s.shape) for u in ddp.plan.units for s in u.slots]


def test_interleaved_groups_stay_whole_under_contiguous_and_split_by_group_under_all():
    """Two query groups per TP shard interleave Q, K and V per group: contiguous keeps them on one
    owner (no block slots); all makes each block its rows of both groups (two runs)."""
    contiguous, apart = (run_workers(1, _plan_worker_gqa, mode)[0] for mode in ("contiguous", "all"))
    assert all(name == param for name, param, _ in contiguous)
    blocks = [runs for name, param, runs in apart if name != param]
    assert len(blocks) == 6 and all(runs[3] == 2 for runs in blocks), blocks


def _plan_worker_gqa(rank, world_size, mode):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron()
    config, model = tiny_gpt()  # num_query_groups 2
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=mode), model)
    return [(s.name, s.param_name, s.runs()) for u in ddp.plan.units for s in u.slots]


def _ckpt_worker(rank, world_size, path, steps, mode, model_overrides):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer

    init_megatron()
    config, model = tiny_gpt(by_global_name=True, **model_overrides)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=mode), model)
    opt = get_megatron_optimizer(optimizer_config(), [ddp])
    for step in range(1, steps + 1):
        opt.zero_grad()
        lm_loss(ddp, micro_batch(step, 0, rank), 1).backward()
        ddp.finish_grad_sync()
        opt.step()
    request = dist_checkpoint(ddp, opt, path, save=bool(steps))
    keys = sorted({sh.key for shards in request["model"].values() for sh in shards})
    return {
        "opt": opt.state_dict(),
        "weights": ddp.full_state_dict(),
        "shapes": {n: s for u in ddp.units for n, s in u.shapes.items()},
        "runs": _block_runs(ddp),
        "keys": keys,
    }


@pytest.mark.parametrize(
    "saved_mode,loaded_mode,model",
    [("contiguous", "whole", MQA), ("whole", "contiguous", MQA), ("all", "whole", MHA), ("whole", "all", MHA)],
)
def test_checkpoint_moves_between_blocks_apart_and_whole(tmp_path, saved_mode, loaded_mode, model):
    path = str(tmp_path / "ckpt")
    saved = run_workers(2, _ckpt_worker, path, 2, saved_mode, model)
    loaded = run_workers(2, _ckpt_worker, path, 0, loaded_mode, model)
    # megatron-core's keys either way: a block saves its rows of the whole weight's tensor.
    assert saved[0]["keys"] == loaded[0]["keys"]
    assert not any("[" in key for key in saved[0]["keys"])
    for name, tensor in saved[0]["weights"].items():
        assert torch.equal(loaded[0]["weights"][name], tensor), name
    expected = assemble_optimizer_state([r["opt"] for r in saved], saved[0]["shapes"], saved[0]["runs"])
    got = assemble_optimizer_state([r["opt"] for r in loaded], loaded[0]["shapes"], loaded[0]["runs"])
    assert set(got) == set(expected)
    for name, state in expected.items():
        for key, tensor in state.items():
            assert not torch.isnan(tensor).any(), f"{name}.{key}"
            assert torch.equal(got[name][key], tensor), f"{name}.{key}"
