"""Owner-segment communication (runtime/comm.py) on gloo at W=3 (uneven segments): one collective
per unit for the gather and one for the reduction, exactly the unit's bytes, the same numbers as
the per-owner path, any payload dtype, bf16 reductions summed in fp32, and traffic per iteration
equal to ZeRO-3's formula for a tied and an untied model."""

import torch

from megatron_mfsdp.testing import count_collectives, init_megatron, lm_loss, micro_batch, run_workers, tiny_gpt

W, MICRO = 3, 2
OWNER_OPS = ("all_to_all_single", "broadcast", "batch_isend_irecv", "send", "recv", "isend", "irecv")


def _one_iteration(rank, tied: bool, coalesce: bool):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    config, model = tiny_gpt(tied=tied, num_layers=1)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False, coalesce=coalesce), model)
    with count_collectives() as calls:
        for k in range(MICRO):
            lm_loss(ddp, micro_batch(1, k, rank), MICRO).backward()
        ddp.finish_grad_sync()
    owner_ops = [i for i, (name, _) in enumerate(calls) if name in OWNER_OPS]  # not the loss's TP all-reduces
    return {
        "calls": [calls[i][0] for i in owner_ops],
        "tensors": [calls.tensors[i] for i in owner_ops],
        "traffic": dict(ddp.comm.traffic),
        "model": ddp.traffic_per_iteration(MICRO),
        "line": ddp.traffic_line(MICRO),
        "units": [(s.layout.numel, s.layout.segment_numel(rank), s.grad_params > 0) for s in ddp.units],
        "owner_parts": [
            sum(1 for r in range(W) for a, b in (s.layout.matrix_range(r), s.layout.tail_range(r)) if b > a)
            for s in ddp.units
        ],
        "grads": [s.grad_segment.clone() for s in ddp.units],
    }


def _iteration_worker(rank, world_size):
    init_megatron()
    return {
        (tied, coalesce): _one_iteration(rank, tied, coalesce) for tied in (True, False) for coalesce in (True, False)
    }


def _gather_paths_worker(rank, world_size):
    """Every unit gathered by all-to-all, by batched p2p (NCCL's path, run here on gloo) and by per-owner
    broadcasts; an FP8 payload as bytes; a bf16 reduction against the fp32 sum of its rows."""
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron()
    config, model = tiny_gpt(num_layers=1)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False), model)
    comm, out = ddp.comm, {"p2p_calls": [], "equal": [], "fp8_equal": [], "bf16": []}
    for state in ddp.units:
        layout, seg = state.layout, state.param_segment
        a2a = comm.start_gather(layout, seg).wait()
        comm.coalesce = False
        per_owner = comm.start_gather(layout, seg).wait()
        comm.coalesce, comm.p2p = True, True
        with count_collectives() as calls:
            p2p = comm.start_gather(layout, seg).wait()
            fp8_p2p = comm.start_gather(layout, seg.to(torch.float8_e4m3fn)).wait()
        comm.p2p = False
        fp8_a2a = comm.start_gather(layout, seg.to(torch.float8_e4m3fn)).wait()
        out["p2p_calls"].append([name for name, _ in calls])
        out["equal"].append(torch.equal(a2a, per_owner) and torch.equal(a2a, p2p))
        want = a2a.to(torch.float8_e4m3fn).view(torch.uint8)
        out["fp8_equal"].append(
            torch.equal(fp8_a2a.view(torch.uint8), want) and torch.equal(fp8_p2p.view(torch.uint8), want)
        )
        out["bf16"].append(_bf16_reduce(rank, comm, state))
    return out


def _bf16_reduce(rank, comm, state):
    layout, scale = state.layout, 1.0 / W

    def grads(r):
        g = torch.Generator().manual_seed(1000 * r + layout.index)
        return {slot.name: torch.randn(slot.shape, generator=g) for slot, _ in state.params}

    with count_collectives() as calls:
        summed = comm.start_reduce(layout, comm.pack_grads(layout, grads(rank), torch.bfloat16, scale)).wait()
    (m0, m1), (t0, t1) = layout.matrix_range(rank), layout.tail_range(rank)
    rows = []
    for r in range(W):  # rank r's contribution in layout order, cast to bf16 and scaled as the wire carries it
        flat = torch.zeros(layout.numel, dtype=torch.bfloat16)
        for slot, _ in state.params:
            flat[slot.offset : slot.offset + slot.numel].copy_(grads(r)[slot.name].reshape(-1))
        rows.append(torch.cat([flat[m0:m1], flat[t0:t1]]).mul_(scale))
    fp32_sum, bf16_sum = rows[0].float(), rows[0].clone()
    for row in rows[1:]:
        fp32_sum.add_(row)
        bf16_sum.add_(row)
    return {
        "wire": [d for t in calls.tensors for _, d in t],
        "exact": summed.dtype == torch.float32 and torch.equal(summed, fp32_sum),
        "bf16_would_differ": not torch.equal(bf16_sum.float(), fp32_sum),
    }


def test_one_collective_per_unit_with_exactly_the_units_bytes_and_traffic_at_zero3():
    results = run_workers(W, _iteration_worker)
    for rank, by_config in enumerate(results):
        for tied in (True, False):
            new, old = by_config[(tied, True)], by_config[(tied, False)]
            units = new["units"]
            trained = [u for u in units if u[2]]
            # The per-owner path's numbers, bitwise: packing in segment order changes only where bytes sit.
            assert all(torch.equal(a, b) for a, b in zip(new["grads"], old["grads"]))
            gathers, reduces = MICRO * (len(units) + len(trained)), MICRO * len(trained)
            assert new["calls"] == ["all_to_all_single"] * (gathers + reduces), new["calls"]
            dtypes = [t[0][1] for t in new["tensors"]]  # the output buffer: uint8 gathers, fp32 reductions
            assert dtypes.count(torch.uint8) == gathers and dtypes.count(torch.float32) == reduces
            # A gather receives exactly the other ranks' segments; a reduction sends the unit and receives
            # W rows of this rank's segment: nothing is padded to the largest owner.
            got = sorted(sum(k for k, _ in t[:1]) for t in new["tensors"] if t[0][1] == torch.uint8)
            want = sorted([4 * (u - s) for u, s, _ in units] * MICRO + [4 * (u - s) for u, s, _ in trained] * MICRO)
            assert got == want
            red = [(t[0][0], t[1][0]) for t in new["tensors"] if t[0][1] == torch.float32]
            assert sorted(red) == sorted([(W * s, u) for u, s, _ in trained] * MICRO)
            # Before coalescing: one broadcast per non-empty owner part, two all-to-alls per reduction.
            parts = old["owner_parts"]
            broadcasts = MICRO * (sum(parts) + sum(p for p, u in zip(parts, units) if u[2]))
            assert old["calls"].count("broadcast") == broadcasts
            assert old["calls"].count("all_to_all_single") == 2 * reduces
            print(
                f"rank {rank} tied={tied}: calls per micro-batch "
                f"{len(old['calls']) // MICRO} -> {len(new['calls']) // MICRO}"
            )
    for tied in (True, False):
        for coalesce in (True, False):
            rs = [r[(tied, coalesce)] for r in results]
            model = rs[0]["model"]
            for phase, key in (("forward gather", "forward"), ("backward gather", "backward"), ("reduction", "reduce")):
                moved = sum(r["traffic"][key] for r in rs)  # what every rank received (gathers) or sent off-rank
                ours, zero3 = model[phase]
                assert moved == ours == zero3 > 0, (tied, coalesce, phase, moved, ours, zero3)
            assert "ZeRO-3 x1.00" in rs[0]["line"] and "x1.0" in rs[0]["line"]
            print(rs[0]["line"])


def test_gather_paths_agree_move_any_dtype_and_bf16_reductions_sum_in_fp32():
    results = run_workers(W, _gather_paths_worker)
    for r in results:
        assert all(r["equal"]) and all(r["fp8_equal"])
        assert all(calls == ["batch_isend_irecv"] * 2 for calls in r["p2p_calls"]), r["p2p_calls"]
        for b in r["bf16"]:
            assert b["exact"] and set(b["wire"]) == {torch.bfloat16}, b
        assert any(b["bf16_would_differ"] for b in r["bf16"])  # the fp32 accumulation is not a no-op here
