"""MatrixFSDP composed with tensor parallelism and hybrid (replicate x shard) sharding.

Workers build the tiny GPT with layout-independent (global-name-seeded) weights,
so every layout starts from the 1 x 1 x 1 model; pretrain_gpt.py runs check the
same through the command line."""

import pytest
import torch

from megatron_mfsdp.testing import (
    count_collectives,
    forward_step,
    init_megatron,
    micro_batch,
    optimizer_config,
    reference_train,
    run_workers,
    tiny_gpt,
)

STEPS = 3
NS_STEPS = 5


def _layout_worker(rank, world_size, tp, mode, pp=1, num_micro=1, qkv_owners="whole"):
    """Train the tiny GPT at TP x PP x DP through megatron-core's schedule; return the
    full (TP=1, PP=1) parameters, the collectives of each step and the bytes held."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mfsdp import (
        MatrixFSDP,
        MatrixFSDPConfig,
        ProcessGroups,
        configure_schedule,
        forward_backward,
        get_megatron_optimizer,
    )

    init_megatron(tp=tp, pp=pp)
    config, model = tiny_gpt(
        by_global_name=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp = MatrixFSDP(config, MatrixFSDPConfig(split_qkv_owners=qkv_owners), model, ProcessGroups.from_parallel_state())
    opt = get_megatron_optimizer(optimizer_config(muon_tp_mode=mode), [ddp])
    configure_schedule([ddp], opt)
    dp_rank = parallel_state.get_data_parallel_rank()
    step_calls = []
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        batches = iter([micro_batch(step, k, dp_rank) for k in range(num_micro)])
        forward_backward(forward_step, batches, [ddp], num_micro, 16, 2)
        with count_collectives() as calls:
            assert opt.step()[0]
        step_calls.append(list(calls))
    owned_blocks = sum(len(p.split_rows or (1,)) for p in opt.owned_pieces() if p.rule.startswith("muon"))
    # Reassemble full (TP=1) tensors from the TP shards and collect every stage's names.
    full = {}
    params = dict(model.named_parameters())
    names = ddp.global_names
    for name, tensor in ddp.full_state_dict().items():
        param = params.get(name)
        if param is None:
            continue
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            dist.all_gather(parts, tensor, group=parallel_state.get_tensor_model_parallel_group())
            tensor = torch.cat(parts, dim=param.partition_dim)
        full[names[name]] = tensor
    return {
        "params": full,
        "step_calls": step_calls,
        "owned_blocks": owned_blocks,
        "block_slots": sum(s.param is not None for u in ddp.plan.units for s in u.slots),
        "bytes": sum({**ddp.local_bytes(), **opt.local_bytes()}.values()),
    }


def _reference_worker(rank, world_size, dp_size, blocks, num_micro=1):
    init_megatron()
    config, model = tiny_gpt(by_global_name=True)
    return reference_train(model, config, optimizer_config(), dp_size, STEPS, num_micro, muon_blocks=blocks)


@pytest.fixture(scope="module")
def reference_dp2():
    return {blocks: run_workers(1, _reference_worker, 2, blocks)[0] for blocks in (1, 2)}


def _max_delta(results, reference):
    """Largest parameter difference; ``results`` may be several stages' dicts."""
    merged = {}
    for r in results if isinstance(results, list) else [results]:
        merged.update(r["params"])
    assert set(merged) == set(reference["params"])
    return max((merged[n] - ref).abs().max().item() for n, ref in reference["params"].items())


def test_tp2_pp2_dp2_blockwise_has_no_tensor_collective_in_step():
    """1F1B over two stages with the tied embedding split between them, at TP2 x PP2 x DP2 (TP1 x
    PP2 x DP2's losses are in tests/e2e/test_pretrain.py, every layout)."""
    results = run_workers(8, _layout_worker, 2, "blockwise", 2, 2)
    reference = run_workers(1, _reference_worker, 2, 2, 2)[0]
    worst = _max_delta(results, reference)
    print(f"\nTP=2 x PP=2 x DP=2 blockwise, 2 micro-batches: max |param delta| = {worst:.3e}")
    assert worst < 2e-4
    for r in results:
        assert all(calls == [("all_reduce", 2)] for calls in r["step_calls"])


@pytest.mark.parametrize("mode,blocks", [("blockwise", 2), ("distributed", 1), ("duplicated", 1)])
def test_tp2_dp2_matches_single_process(mode, blocks, reference_dp2):
    """blockwise equals a single process orthogonalizing the same two blocks per matrix;
    distributed and duplicated equal full-matrix Muon. TP changes the order of the
    row-parallel sums, so agreement is to a tolerance, not bitwise: the worst element is a
    QKV bias whose near-zero gradient AdamW normalizes (measured ~7e-5 after 3 steps at
    lr 1e-2), while blockwise and full-matrix Muon differ by ~2e-2."""
    results = run_workers(4, _layout_worker, 2, mode)
    worst = _max_delta(results[0], reference_dp2[blocks])
    print(f"\nTP=2 x DP=2 {mode}: max |param delta| vs single process = {worst:.3e}")
    assert worst < 2e-4
    if mode != "blockwise":  # full-matrix modes differ from the blockwise answer
        assert _max_delta(results[0], reference_dp2[2]) > 5e-3
    for r in results:
        for calls in r["step_calls"]:
            names = [name for name, _ in calls]
            if mode == "blockwise":
                assert calls == [("all_reduce", 2)]  # no tensor collective at all
            elif mode == "distributed":
                # the grad stats, then one Gram all-reduce per NS iteration per owned block
                assert names == ["all_reduce"] * (1 + NS_STEPS * r["owned_blocks"])
            else:
                assert names == ["all_reduce"] + ["all_gather_single"] * (len(calls) - 1)
        print(
            f"  {mode}: {len(r['step_calls'][0])} collectives in one step on a rank owning {r['owned_blocks']} blocks"
        )


@pytest.mark.parametrize("mode", ["distributed", "duplicated"])
def test_tp2_dp2_qkv_blocks_apart_match_single_process(mode, reference_dp2):
    """--mfsdp-split-qkv-owners contiguous at TP=2 (one query group per TP shard): each shard's Q,
    K and V rows are slots of their own; the full-matrix TP modes rebuild each block over TP (a
    block's TP shards are its query groups' rows, in group order) and equal full-matrix Muon."""
    results = run_workers(4, _layout_worker, 2, mode, 1, 1, "contiguous")
    assert all(r["block_slots"] == 6 for r in results)  # Q, K, V of 2 layers
    worst = _max_delta(results[0], reference_dp2[1])
    print(f"\nTP=2 x DP=2 {mode}, Q/K/V apart: max |param delta| vs single process = {worst:.3e}")
    assert worst < 2e-4
    for r in results:
        for calls in r["step_calls"]:
            if mode == "distributed":
                assert [name for name, _ in calls] == ["all_reduce"] * (1 + NS_STEPS * r["owned_blocks"])


def test_memory_per_rank_falls_with_dp_shard_size_at_tp2():
    tp2_dp1 = run_workers(2, _layout_worker, 2, "blockwise")
    tp2_dp2 = run_workers(4, _layout_worker, 2, "blockwise")
    one, two = max(r["bytes"] for r in tp2_dp1), max(r["bytes"] for r in tp2_dp2)
    print(f"\nTP=2: bytes per rank DP=1 {one:,}, DP=2 {two:,} (ratio {two / one:.3f})")
    assert two <= 0.55 * one + 64 * 128 * 4 * 3  # half, plus at most one matrix of imbalance


def _relayout_worker(rank, world_size):
    import os

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from megatron_mfsdp.groups import initialize_model_parallel

    def threads():
        return len(os.listdir("/proc/self/task"))

    counts = []
    for tp in (2, 1, 2, 1, 2, 1):
        initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
        dist.barrier()
        counts.append((threads(), len(c10d._world.pg_map)))
    return counts


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_layout_change_destroys_the_old_groups():
    """megatron's destroy_model_parallel only forgets its groups; each gloo group keeps threads
    that poll. groups.initialize_model_parallel destroys them: six layout changes leave the
    group count where the first two layouts put it, and the threads within a few of it (without
    the destruction each TP2 layout adds about 50 threads per rank)."""
    for counts in run_workers(2, _relayout_worker):
        print(f"\n(threads, groups) after each of six layouts: {counts}")
        assert [g for _, g in counts[2:]] == [g for _, g in counts[:2]] * 2, counts
        assert max(t for t, _ in counts[2:]) <= max(t for t, _ in counts[:2]) + 5, counts


def _failing_worker(rank, world_size):
    from megatron_mfsdp.groups import initialize_model_parallel

    initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    raise ValueError("a task that fails after building its layout")


def _pid_worker(rank, world_size):
    import os

    from torch.distributed import distributed_c10d as c10d

    return os.getpid(), len(c10d._world.pg_map)


def test_a_lone_rank_pool_survives_a_failed_task_without_its_groups():
    """A pool of one rank is kept after a task fails (no other rank can be out of step; the tests
    that expect errors restarted it each time, seconds apiece), with the failed task's groups gone."""
    before = run_workers(1, _pid_worker)[0]
    with pytest.raises(RuntimeError, match="a task that fails"):
        run_workers(1, _failing_worker)
    after = run_workers(1, _pid_worker)[0]
    assert after == (before[0], 1), (before, after)  # the same process, holding the world group alone
