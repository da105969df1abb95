"""The owner collectives' algorithms (runtime/comm.py ``parts``, runtime/algorithms.py ``two_level`` and
``padded``), each forced for every unit, on gloo with a simulated node layout of 2 ranks per node
(node_levels.py): W = 4 as 2 nodes of 2, and W = 8 as 4 nodes of 2 on one plan.

- the gather is a copy: every rank's full buffer equals the unit's, bitwise, whatever the algorithm;
- the reduction: ``parts`` in rank order is the chain, bitwise the single-process rank-order sum; the
  others sum in another order (two_level: each node's sum, then across nodes) and are held to the
  fp32 reference within twice the recursive-summation bound;
- the bytes each rank's LinkCalls charge per level equal a hand computation for the adversarial unit
  (every matrix on rank 1) at W = 4;
- ranks that disagree on a unit (or an algorithm) raise in the signature check instead of hanging in a
  level's blocking wait.
"""

import pytest
import torch

from megatron_mfsdp.testing import run_workers

MATRICES = [("fc1", (12, 10)), ("fc2", (10, 12)), ("qkv", (9, 10)), ("proj", (10, 6))]
TAILS = {"odd": [("n1", (7,)), ("b1", (5,)), ("b2", (3,))], "even": [("n1", (16,)), ("b1", (8,)), ("b2", (8,))]}
MATRIX_NUMEL = sum(a * b for _, (a, b) in MATRICES)  # 390
ALGORITHMS = ("parts", "two_level", "padded")


def unit_layout(world, owners, tail):
    from megatron_mfsdp.placement import ParamSpec, UnitSpec
    from megatron_mfsdp.placement.layout import layout_units

    params = [ParamSpec(n, s, "muon", "whole") for n, s in MATRICES]
    params += [ParamSpec(n, s, "adamw", "slice") for n, s in TAILS[tail]]
    return layout_units([UnitSpec("u", params)], world, dict(zip([n for n, _ in MATRICES], owners)), "t").units[0]


def plans(world):
    return {
        "all on rank 1": [1] * 4,
        "spread": [i * (world - 1) // 3 for i in range(4)],
        "all on the last": [world - 1] * 4,
    }


def segment_of(layout, rank, full):
    (m0, m1), (t0, t1) = layout.matrix_range(rank), layout.tail_range(rank)
    return torch.cat([full[m0:m1], full[t0:t1]])


def grads(layout, rank):
    g = torch.Generator().manual_seed(7919 * rank + 13)
    return {s.name: torch.randn(s.shape, generator=g) for s in layout.slots}


def reference(layout, world):
    """Every rank's scaled contribution in layout order, and their sum in rank order in fp32."""
    rows = []
    for r in range(world):
        row, g = torch.zeros(layout.numel), grads(layout, r)
        for s in layout.slots:
            row[s.offset : s.offset + s.numel] = g[s.name].reshape(-1) * (1.0 / world)
        rows.append(row)
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total, rows


def levels_worker(rank, world, plan_names):
    import torch.distributed as dist

    from megatron_mfsdp.node_levels import build_node_levels
    from megatron_mfsdp.runtime.comm import SegmentComm

    levels = build_node_levels(dist.group.WORLD, 2)
    out = {}
    for plan in plan_names:
        for tail in TAILS:
            layout = unit_layout(world, plans(world)[plan], tail)
            full = torch.arange(layout.numel, dtype=torch.float32) * 0.25 + 1
            for algorithm in ALGORITHMS:
                for order in ("rank", "ring") if algorithm == "parts" else ("rank",):
                    comm = SegmentComm(shard=dist.group.WORLD, verify=True, reduce_order=order, levels=levels)
                    comm.choose({}, force=(algorithm, algorithm))
                    comm.log = []
                    got = comm.start_gather(layout, segment_of(layout, rank, full)).wait()
                    packed = comm.pack_grads(layout, grads(layout, rank), torch.float32, 1.0 / world)
                    reduced = comm.start_reduce(layout, packed).wait()
                    log = [(e.op, e.level, e.bytes_in, e.bytes_out) for e in comm.log]
                    out[(plan, tail, algorithm, order)] = (torch.equal(got, full), reduced.clone(), log)
    return out


def check(results, world, plan_names):
    for plan in plan_names:
        for tail in TAILS:
            layout = unit_layout(world, plans(world)[plan], tail)
            total, rows = reference(layout, world)
            bound = torch.stack([r.abs() for r in rows]).sum(0) * 2 * (world - 1) * 2.0**-24
            for key in [k for k in results[0] if k[:2] == (plan, tail)]:
                for rank, res in enumerate(results):
                    gathered, reduced, _ = res[key]
                    want = segment_of(layout, rank, total)
                    assert gathered, (key, rank)
                    if key[2:] == ("parts", "rank"):  # the chain: bitwise the reference
                        assert torch.equal(reduced, want), (key, rank)
                    else:
                        assert (reduced - want).abs().le(segment_of(layout, rank, bound)).all(), (key, rank)


@pytest.fixture(scope="module")
def four():
    names = list(plans(4))
    return run_workers(4, levels_worker, names), names


def test_every_algorithm_gathers_bitwise_and_reduces_within_the_bound_at_w4(four):
    results, names = four
    check(results, 4, names)


def test_bytes_per_rank_per_level_at_w4_match_a_hand_computation(four):
    """Every matrix on rank 1 (node 0, local 1: rail {1, 3}), an even tail of 32 fp32 (slices of 8).
    two_level gather: the matrices (390 x 4 = 1560 B) go over rail 1 (rank 1 out, rank 3 in: a ring of
    two, the last only receives), then inside each node from local 1 to local 0; the tail over each
    rail (1 slice of 32 B in and out), then inside the node (a block of 2 slices, 64 B in and out).
    The reduction is the mirror (in and out swapped). padded: one call of W slices of the largest
    segment (390 + 8 = 398 elements): 3 x 1592 B in and out on every rank."""
    results, _ = four
    m, tail_rail, tail_node = MATRIX_NUMEL * 4, 32, 64
    gather = {  # rank: ((inter in, inter out), (intra in, intra out))
        0: ((tail_rail, tail_rail), (m + tail_node, tail_node)),
        1: ((tail_rail, m + tail_rail), (tail_node, m + tail_node)),
        2: ((tail_rail, tail_rail), (m + tail_node, tail_node)),
        3: ((m + tail_rail, tail_rail), (tail_node, m + tail_node)),
    }
    for rank, res in enumerate(results):
        log = res[("all on rank 1", "even", "two_level", "rank")][2]
        (ei, eo), (ai, ao) = gather[rank]
        assert log == [
            ("gather", "inter", ei, eo),
            ("gather", "intra", ai, ao),
            ("reduce", "inter", eo, ei),
            ("reduce", "intra", ao, ai),
        ], (rank, log)
        padded = res[("all on rank 1", "even", "padded", "rank")][2]
        assert padded == [("gather", "flat", 3 * 1592, 3 * 1592), ("reduce", "flat", 3 * 1592, 3 * 1592)]
        parts = res[("all on rank 1", "even", "parts", "ring")][2]
        assert [e[:2] for e in parts] == [("gather", "flat"), ("reduce", "flat")]


def test_every_algorithm_at_w8_as_four_nodes_of_two():
    names = ["spread"]
    check(run_workers(8, levels_worker, names), 8, names)


def mismatch_worker(rank, world):
    """Rank 1 gathers the unit under another index (the data moves alike: only the check can tell), with
    each algorithm forced, then a matching reduction; and a bare signature whose algorithm differs."""
    import dataclasses

    import torch.distributed as dist

    from megatron_mfsdp.node_levels import build_node_levels
    from megatron_mfsdp.placement import GATHER, check_signature
    from megatron_mfsdp.placement.verify import ALGORITHM_STRIDE
    from megatron_mfsdp.runtime.comm import SegmentComm

    levels = build_node_levels(dist.group.WORLD, 2)
    layout = unit_layout(world, plans(world)["spread"], "odd")
    errors = {}
    for algorithm in ALGORITHMS[1:]:
        comm = SegmentComm(shard=dist.group.WORLD, reduce_order="ring", levels=levels)
        comm.choose({}, force=(algorithm, algorithm))
        shifted = dataclasses.replace(layout, index=layout.index + (rank == 1))
        try:
            comm.start_gather(shifted, torch.zeros(layout.segment_numel(rank))).wait()
        except RuntimeError as e:
            errors[algorithm] = str(e)
        reduced = comm.start_reduce(layout, comm.pack_grads(layout, {}, torch.float32, 1.0)).wait()
        errors[algorithm + " then matching"] = bool(torch.equal(reduced, torch.zeros_like(reduced)))
    try:
        check_signature(dist.group.WORLD, 0, GATHER + ALGORITHM_STRIDE * (rank == 1), 10)
    except RuntimeError as e:
        errors["algorithm"] = str(e)
    return errors


def test_a_mismatched_unit_or_algorithm_raises_instead_of_hanging(four):
    for rank, errors in enumerate(run_workers(4, mismatch_worker)):
        for algorithm in ALGORITHMS[1:]:
            said = f"rank {rank}: gather (algorithm {ALGORITHMS.index(algorithm)}) unit"
            assert "collective mismatch" in errors[algorithm] and said in errors[algorithm], errors[algorithm]
            assert "units " in errors[algorithm] and errors[algorithm + " then matching"]
        assert f"rank {rank}: gather" in errors["algorithm"] and "ops 1 to 11" in errors["algorithm"]
