"""Owner-segment communication (runtime/comm.py) on gloo at W = 2, 4 and 8, on a unit whose every
matrix sits on one rank (the adversarial plan: the owner fan-out of the older all-to-all and p2p
paths was W x that rank's segment on its link) and on a unit spread over the ranks:

- the gather gives every rank the full buffer, bitwise, for any payload dtype (FP8 bytes included),
  with one broadcast per owner part and one all-gather of the padded tail;
- the rank-ordered reduction is bitwise the single-process sum (contributions added in rank order
  in fp32, bf16 wires included, chunked or not); the ring reduction is within the bound of a sum
  in another order;
- every call is charged as NCCL's rings move it, at the torch call site (runtime/call_log.py): the
  comm's own counters equal those charges and the prediction from the layout (runtime/traffic.py);
- the busiest rank of each gather and ring reduction moves at most W/(W-1) x 1.02 of ZeRO-3's
  bytes per rank; the rank-ordered chain's busiest rank moves what its schedule says, at most one
  unit plus the owner's segment (no W x segment anywhere), and no buffer exceeds one unit plus the
  tail's padding.

A training iteration of the tiny GPT then checks the start-up line's prediction against what every
rank's comm recorded, for both reduction orders and a tied and an untied model."""

import pytest
import torch

from megatron_mfsdp.testing import count_collectives, init_megatron, lm_loss, micro_batch, run_workers, tiny_gpt

MATRICES = [("fc1", (12, 10)), ("fc2", (10, 12)), ("qkv", (9, 10)), ("proj", (10, 6))]
TAILS = {"odd": [("n1", (7,)), ("b1", (5,)), ("b2", (3,))], "even": [("n1", (16,)), ("b1", (8,)), ("b2", (8,))]}
U_ELEMENTS = sum(a * b for _, (a, b) in MATRICES)


def _layout(world, owners, tail):
    from megatron_mfsdp.placement import ParamSpec, UnitSpec
    from megatron_mfsdp.placement.layout import layout_units

    params = [ParamSpec(n, s, "muon", "whole") for n, s in MATRICES] + [
        ParamSpec(n, s, "adamw", "slice") for n, s in TAILS[tail]
    ]
    return layout_units([UnitSpec("u", params)], world, dict(zip([n for n, _ in MATRICES], owners)), "test").units[0]


def _plans(world):
    spread = [i % world for i in range(len(MATRICES))]
    return {
        "all on rank 1": [min(1, world - 1)] * 4,
        "all on the middle rank": [world // 2] * 4,  # the chain passes it twice (runtime/chain.py)
        "all on the last": [world - 1] * 4,
        "spread": spread,
    }


def _grads(layout, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(7919 * rank + 13)
    return {s.name: torch.randn(s.shape, generator=g).to(dtype) for s in layout.slots}


def _flat(layout, grads, scale, dtype):
    """Rank's contribution in layout order, scaled in the wire dtype as pack_grads scales it."""
    flat = torch.zeros(layout.numel, dtype=dtype)
    for s in layout.slots:
        flat[s.offset : s.offset + s.numel] = grads[s.name].reshape(-1).to(dtype) * scale
    return flat


def _segment_of(layout, rank, full):
    (m0, m1), (t0, t1) = layout.matrix_range(rank), layout.tail_range(rank)
    return torch.cat([full[m0:m1], full[t0:t1]])


def _op(comm, start):
    """Run one unit operation; return (its result, the torch calls it made, the comm's own record)."""
    comm.log = []
    with count_collectives() as calls:
        pending = start()
        out = pending.wait()
    return out, calls, comm.log


def _unit_worker(rank, world, wire_dtype, chunk_bytes):
    import torch.distributed as dist

    from megatron_mfsdp.groups import ProcessGroups
    from megatron_mfsdp.runtime.comm import SegmentComm

    groups = ProcessGroups(dp=dist.group.WORLD, dp_shard=dist.group.WORLD)
    out = {}
    for plan, owners in _plans(world).items():
        for tail in TAILS:
            layout = _layout(world, owners, tail)
            full = torch.arange(layout.numel, dtype=torch.float32) * 0.25 + 1
            res = out[(plan, tail)] = {}
            for order in ("rank", "ring"):
                comm = SegmentComm(groups, verify=False, reduce_order=order)
                comm.chunk_bytes = chunk_bytes
                segment = _segment_of(layout, rank, full)
                got, calls, log = _op(comm, lambda c=comm, lay=layout, seg=segment: c.start_gather(lay, seg))
                res[("gather", order)] = _record(got, calls, log, comm)
                raw = _segment_of(layout, rank, full).view(torch.uint8)  # FP8 payloads travel as bytes
                got_bytes = comm.start_gather(_byte_layout(layout, 4), raw).wait()
                res[("gather", order)]["bytes_ok"] = torch.equal(got_bytes, full.view(torch.uint8))
                packed = comm.pack_grads(layout, _grads(layout, rank), wire_dtype, 1.0 / world)
                got, calls, log = _op(comm, lambda c=comm, lay=layout, p=packed: c.start_reduce(lay, p))
                res[("reduce", order)] = _record(got, calls, log, comm)
            res["full"] = full
    return out


def _byte_layout(layout, elsize):
    import dataclasses

    return dataclasses.replace(
        layout,
        slots=[],
        matrix_numel=layout.matrix_numel * elsize,
        tail_numel=layout.tail_numel * elsize,
        matrix_bounds=[b * elsize for b in layout.matrix_bounds],
        tail_bounds=[b * elsize for b in layout.tail_bounds],
    )


def _record(result, calls, log, comm):
    owner_calls = [c for c in calls if c.name not in ("all_gather_object", "barrier")]
    return {
        "result": result.clone(),
        "calls": [c.name for c in owner_calls],
        "wire": sorted({d for c in owner_calls for d in c.dtypes}, key=str),
        "charged_at_calls": tuple(map(sum, zip((0, 0), *(c.link for c in owner_calls)))),
        "log": [(e.op, e.bytes_in, e.bytes_out) for e in log],
        "transient": comm.transient,
    }


def _reference(layout, world, wire_dtype):
    """The single-process sum: each rank's scaled contribution added in rank order, in fp32."""
    rows = [_flat(layout, _grads(layout, r), 1.0 / world, wire_dtype) for r in range(world)]
    total = rows[0].float().clone()
    for row in rows[1:]:
        total.add_(row)
    return total, rows


@pytest.mark.parametrize("world", [2, 4, 8])
def test_unit_collectives_move_one_unit_per_rank_and_sum_exactly(world):
    from megatron_mfsdp.runtime.traffic import busiest, gather_links, owner_parts, reduce_links, zero3_bytes

    results = run_workers(world, _unit_worker, torch.float32, 4 << 20)
    for key in results[0]:
        plan, tail = key
        layout = _layout(world, _plans(world)[plan], tail)
        total, rows = _reference(layout, world, torch.float32)
        bound = torch.stack([r.abs() for r in rows]).sum(0) * 2 * (world - 1) * 2.0**-24
        parts = len(owner_parts(layout))
        for order in ("rank", "ring"):
            gathers = [r[key][("gather", order)] for r in results]
            reduces = [r[key][("reduce", order)] for r in results]
            for rank, (g, red) in enumerate(zip(gathers, reduces)):
                assert torch.equal(g["result"], results[rank][key]["full"]) and g["bytes_ok"], (key, order, rank)
                want = _segment_of(layout, rank, total)
                if order == "rank":  # bitwise the reference's rank-order sum
                    assert torch.equal(red["result"], want), (key, rank)
                else:  # a sum in the ring's order: within twice the recursive-summation bound
                    assert (red["result"] - want).abs().le(_segment_of(layout, rank, bound)).all(), (key, rank)
                assert g["calls"] == ["broadcast"] * parts + ["all_gather_single"], g["calls"]
                if order == "ring":
                    assert red["calls"] == ["reduce"] * parts + ["reduce_scatter_single"], red["calls"]
                else:
                    assert set(red["calls"]) <= {"isend", "irecv"}, red["calls"]
                # the comm's own counters = the charges at the torch call sites = the layout's prediction
                for rec, op, predicted in (
                    (g, "gather", gather_links(layout, 4)),
                    (red, "reduce", reduce_links(layout, order, 4)),
                ):
                    assert rec["log"] == [(op, *rec["charged_at_calls"])] == [(op, *predicted[rank])], (key, order, op)
                assert max(g["transient"], red["transient"]) <= 4 * (layout.numel + world - 1), (key, order)
            zero3 = zero3_bytes(layout.numel, 4, world)
            gather_busiest = busiest([g["log"][0][1:] for g in gathers])
            reduce_busiest = busiest([r["log"][0][1:] for r in reduces])
            assert gather_busiest <= zero3 * world / (world - 1) * 1.02, (key, gather_busiest, zero3)
            if order == "ring" or plan == "all on the last":
                assert reduce_busiest <= zero3 * world / (world - 1) * 1.02, (key, order, reduce_busiest, zero3)
            else:  # the chain passes a middle owner twice: one unit plus its segment, never W x it
                owned = max(layout.segment_numel(r) for r in range(world))
                assert reduce_busiest <= 4 * (layout.numel + world + owned), (key, reduce_busiest)
            ratios = f"gather {gather_busiest / zero3:.3f}, reduce {reduce_busiest / zero3:.3f}"
            print(f"W={world} {plan}, {tail} tail, {order}: busiest rank / ZeRO-3's per rank: {ratios}")


def test_rank_order_sums_bf16_wires_in_fp32_and_chunks_bitwise():
    """bf16 contributions are summed in fp32 (the reference's sum), and a chain cut into 64-byte
    chunks (16 partial sums a message) gives the same bits; the ring order reduces in the wire dtype."""
    world = 4
    results = run_workers(world, _unit_worker, torch.bfloat16, 64)
    for key in results[0]:
        layout = _layout(world, _plans(world)[key[0]], key[1])
        total, rows = _reference(layout, world, torch.bfloat16)
        for rank, r in enumerate(results):
            rank_order = r[key][("reduce", "rank")]
            assert torch.equal(rank_order["result"], _segment_of(layout, rank, total))
            assert len(rank_order["calls"]) == _chain_messages(layout, rank, 16), (key, rank)
            ring = r[key][("reduce", "ring")]
            assert ring["wire"] == [torch.bfloat16]  # summed in the wire dtype: bf16's rounding bound
            bound = torch.stack([row.float().abs() for row in rows]).sum(0) * 2 * (world - 1) * 2.0**-8
            assert (ring["result"] - _segment_of(layout, rank, total)).abs().le(_segment_of(layout, rank, bound)).all()
        in_bf16 = rows[0].clone()
        for row in rows[1:]:
            in_bf16.add_(row)
        assert not torch.equal(in_bf16.float(), total)  # the fp32 accumulation is not a no-op here


def _chain_messages(layout, rank, chunk):
    """Messages a rank posts in a chained reduction with ``chunk``-element chunks (runtime/chain.py):
    per chunk of each owner part one for each hop it is an end of; per chunk of the padded tail one
    from its predecessor and one to its successor; then the slices from the last rank."""
    from megatron_mfsdp.runtime.chain import chain_hops
    from megatron_mfsdp.runtime.traffic import owner_parts, tail_slice

    world, last = layout.world_size, layout.world_size - 1
    count = sum(
        -(-(hi - lo) // chunk) * sum(rank in hop[:2] for hop in chain_hops(world, owner))
        for owner, lo, hi in owner_parts(layout)
    )
    count += -(-(tail_slice(layout) * world) // chunk) * ((rank > 0) + (rank < last))
    return count + (last if rank == last else 1)


def _iteration_worker(rank, world_size):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron()
    out = {}
    for tied in (True, False):
        for order in ("rank", "ring"):
            config, model = tiny_gpt(tied=tied, num_layers=2)
            ddp = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False, reduce_order=order), model)
            ddp.comm.log = []
            for k in range(2):
                lm_loss(ddp, micro_batch(1, k, rank), 2).backward()
            ddp.finish_grad_sync()
            out[(tied, order)] = {
                "log": [(e.phase, e.unit, e.op, e.bytes_in, e.bytes_out) for e in ddp.comm.log],
                "model": ddp.traffic_per_iteration(2),
                "line": ddp.traffic_line(2),
                "grads": [s.grad_segment.clone() for s in ddp.units],
            }
    return out


def test_start_up_line_predicts_the_busiest_rank_of_every_call_in_an_iteration():
    world = 4
    results = run_workers(world, _iteration_worker)
    for key in results[0]:
        logs = [r[key]["log"] for r in results]
        assert all(len(log) == len(logs[0]) for log in logs)
        phases = {"forward": "forward gather", "backward": "backward gather", "reduce": "reduction"}
        critical = dict.fromkeys(phases.values(), 0)
        for calls in zip(*logs):  # the same unit operation on every rank
            assert len({c[:3] for c in calls}) == 1, calls
            critical[phases[calls[0][0]]] += max(max(c[3], c[4]) for c in calls)
        model = results[0][key]["model"]
        for phase, ours in critical.items():
            assert ours == model[phase][0] > 0, (key, phase, ours, model[phase])
        assert f"reduce order {key[1]}" in results[0][key]["line"] and "ZeRO-3 x" in results[0][key]["line"]
        print(results[0][key]["line"])
    for tied in (True, False):  # the two orders differ only by rounding on the same gradients
        for a, b in zip(results[0][(tied, "rank")]["grads"], results[0][(tied, "ring")]["grads"]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _own_views_worker(rank, world):
    import torch.distributed as dist

    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig
    from megatron_mfsdp.groups import ProcessGroups
    from megatron_mfsdp.runtime.comm import SegmentComm

    groups = ProcessGroups(dp=dist.group.WORLD, dp_shard=dist.group.WORLD)
    layout = _layout(world, _plans(world)["spread"], "odd")
    full = torch.arange(layout.numel, dtype=torch.float32) * 0.25 + 1
    segment = _segment_of(layout, rank, full)
    out = {"own": {}, "added": {}}
    for order in ("rank", "ring"):
        comm = SegmentComm(groups, verify=False, reduce_order=order)
        pending = comm.start_gather(layout, segment, "forward", own_views=True)
        got = pending.wait().clone()
        own = pending.own
        if own is not None:  # the owner's part, read from its segment, completes the buffer
            got[own[0] : own[1]] = segment[: own[1] - own[0]]
        out["own"][order] = (own, torch.equal(got, full), comm.start_gather(layout, segment).own)
        packed = comm.pack_grads(layout, _grads(layout, rank), torch.float32, 1.0 / world)
        joined = comm.start_reduce(layout, packed.clone()).wait()
        target = torch.full((layout.segment_numel(rank),), 0.5)
        comm.start_reduce(layout, packed).add_to(target)
        out["added"][order] = torch.equal(target, joined + 0.5)
    # In a training forward, this rank's own matrices are views of its segment; the others' are not.
    init_megatron()
    config, model = tiny_gpt(num_layers=2)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False, collectives="parts"), model)
    seen = {}

    def record(state):  # (this rank owns the matrix, its weight lies in this rank's segment), per matrix
        lo, hi = state.layout.matrix_range(rank)
        storage = state.param_segment.untyped_storage()
        for slot, p in state.params:
            if slot.param is None and slot.offset < state.layout.matrix_numel:
                at = p.data.data_ptr() - storage.data_ptr()
                seen[(state.index, slot.name)] = (lo <= slot.offset < hi, 0 <= at < storage.nbytes())

    for state in ddp.units:  # the last module's pre-hook runs with the unit gathered
        state.unit.modules[-1].register_forward_pre_hook(lambda m, a, s=state: record(s))
    lm_loss(ddp, micro_batch(1, 0, rank), 2).backward()
    ddp.finish_grad_sync()
    out["views"] = seen
    return out


def test_gather_views_own_matrices_in_the_segment_and_reductions_add_without_joining():
    """The forward/backward gather leaves this rank's matrix part out of the buffer (its owner views
    the segment: a copy of up to a unit saved per gather), bitwise the same weights; a reduction's
    ``add_to`` adds its pieces straight into the accumulator, bitwise ``wait()``'s joined segment."""
    world = 2
    results = run_workers(world, _own_views_worker)
    for rank, r in enumerate(results):
        layout = _layout(world, _plans(world)["spread"], "odd")
        for order, (own, complete, own_default) in r["own"].items():
            assert own == layout.matrix_range(rank) and complete and own_default is None, (rank, order, own)
            assert r["added"][order], (rank, order)
        owned = [v for v in r["views"].values() if v[0]]
        assert owned and all(in_seg == mine for mine, in_seg in r["views"].values()), (rank, r["views"])
        assert len(owned) < len(r["views"]), "a rank owning every matrix would not test the others' side"


def _direct_reduce_worker(rank, world):
    import torch.distributed as dist

    from megatron_mfsdp.groups import ProcessGroups
    from megatron_mfsdp.runtime.comm import SegmentComm

    groups = ProcessGroups(dp=dist.group.WORLD, dp_shard=dist.group.WORLD)
    out = {}
    for plan, owners in _plans(world).items():
        layout = _layout(world, owners, "odd")
        for scale in (1.0 / world, 1.0 / 3):  # a power of two reduces in place; 1/3 packs
            comm = SegmentComm(groups, verify=False, reduce_order="ring")
            packed = comm.start_reduce(layout, comm.pack_grads(layout, _grads(layout, rank), torch.float32, scale))
            want = packed.wait().clone()
            comm.transient = 0
            grads = _grads(layout, rank)
            got, calls, log = _op(
                comm, lambda c=comm, lay=layout, g=grads, s=scale: c.start_reduce_grads(lay, g, torch.float32, s)
            )
            log = list(log)  # the add_to run below logs too
            target = torch.full_like(want, 0.25)
            comm.start_reduce_grads(layout, _grads(layout, rank), torch.float32, scale).add_to(target)
            out[(plan, scale)] = {
                "want": want,
                "got": got,
                "added": target,
                "calls": [c.name for c in calls],
                "log": [(e.op, e.bytes_in, e.bytes_out) for e in log],
                "transient": comm.transient,
            }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_reduction_reduces_whole_matrices_where_they_lie_at_a_power_of_two_scale(world):
    """With a power-of-two scale each matrix's gradient is reduced unpacked (one reduce per matrix, no
    buffer of the unit) and its sum scaled on landing: at W = 2 bitwise the packed reduction, above
    within the bound of a sum in another order; the bytes charged are the packed reduction's. At
    scale 1/3 (not exact) it packs as before."""
    from megatron_mfsdp.runtime.traffic import owner_parts, reduce_links

    results = run_workers(world, _direct_reduce_worker)
    for rank, r in enumerate(results):
        for (plan, scale), rec in r.items():
            layout = _layout(world, _plans(world)[plan], "odd")
            total, rows = _reference(layout, world, torch.float32)
            bound = _segment_of(layout, rank, torch.stack([x.abs() for x in rows]).sum(0) * 2 * (world - 1) * 2.0**-24)
            unit_bytes = 4 * layout.numel
            assert rec["log"] == [("reduce", *reduce_links(layout, "ring", 4)[rank])], (plan, scale)
            if scale == 1.0 / world:
                assert rec["calls"] == ["reduce"] * len(MATRICES) + ["reduce_scatter_single"], rec["calls"]
                assert rec["transient"] < unit_bytes / 4, (plan, rec["transient"])  # the tail's buffers only
                for got, want in ((rec["got"], rec["want"]), (rec["added"], rec["want"] + 0.25)):
                    if world == 2:
                        assert torch.equal(got, want), (plan, rank)
                    else:
                        assert (got - want).abs().le(2 * bound + 2.0**-24).all(), (plan, rank)
            else:
                assert rec["calls"] == ["reduce"] * len(owner_parts(layout)) + ["reduce_scatter_single"]
                assert rec["transient"] >= unit_bytes and torch.equal(rec["got"], rec["want"]), (plan, rank)
