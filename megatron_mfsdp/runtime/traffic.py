"""Link bytes: what one collective call moves in and out of each rank, as NCCL's ring algorithms
move them, and the per-unit figures the start-up traffic line prints.

A claim about scale is a claim about the busiest rank of each call: a sum over an iteration, or a
mean over ranks, hides an owner that sends its matrix to every peer. So every call is charged per
rank, in and out (NCCL src/graph/tuning.cc: Broadcast, Reduce, AllGather and ReduceScatter run
Ring; a point-to-point op moves exactly its bytes):

| call | root / owner | every other rank |
|---|---|---|
| broadcast of n | out n | in n, out n (the ring's last only receives) |
| reduce of n | in n | out n, in n (the ring's first only sends) |
| all-gather / reduce-scatter of W slices of s | - | in and out (W - 1) s |
| all-reduce of n | - | in and out 2 (W - 1) / W n |
| send / recv of n | - | out n / in n |

The ring of a broadcast is taken in rank order from the root (root, root + 1, ..., root - 1) and
the ring of a reduce as its mirror; NCCL orders its rings by topology, which changes who forwards,
not how much. ``SegmentComm`` charges the calls it makes (``LinkCall``); :func:`unit_links`
predicts the same figures from a unit's layout alone, for every rank at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..placement.layout import UnitLayout
from .chain import chain_links

GATHER_OP, REDUCE_OP, REPLICA_OP = "gather", "reduce", "replica"
FLAT, INTRA, INTER = "flat", "intra", "inter"  # a call over the whole group, inside a node, across nodes (a rail)


@dataclass(frozen=True)
class LinkCall:
    """One owner collective of one unit (a group of calls on the wire) as this rank moved it."""

    phase: str  # forward, backward, reduce, other
    unit: int
    op: str  # gather, reduce, replica (the all-reduce of hybrid sharding)
    bytes_in: int
    bytes_out: int
    level: str = FLAT  # flat (the whole shard group), intra (inside a node) or inter (across nodes, on a rail)


def per_level(calls: list[LinkCall]) -> dict[str, tuple[int, int]]:
    """(bytes in, bytes out) of this rank summed per level over ``calls`` (levels without a call left out)."""
    out: dict[str, tuple[int, int]] = {}
    for c in calls:
        out[c.level] = add(out.get(c.level, (0, 0)), (c.bytes_in, c.bytes_out))
    return out


def broadcast_link(nbytes: int, rank: int, root: int, world: int) -> tuple[int, int]:
    """(in, out) of ``rank`` in a ring broadcast of ``nbytes`` from ``root``."""
    if world == 1 or nbytes == 0:
        return 0, 0
    if rank == root:
        return 0, nbytes
    return nbytes, 0 if rank == (root - 1) % world else nbytes


def reduce_link(nbytes: int, rank: int, root: int, world: int) -> tuple[int, int]:
    """(in, out) of ``rank`` in a ring reduce of ``nbytes`` into ``root`` (a broadcast reversed)."""
    received, sent = broadcast_link(nbytes, rank, root, world)
    return sent, received


def slices_link(slice_bytes: int, world: int) -> tuple[int, int]:
    """(in, out) of every rank in a ring all-gather or reduce-scatter of W slices of ``slice_bytes``."""
    return (world - 1) * slice_bytes, (world - 1) * slice_bytes


def all_reduce_link(nbytes: int, world: int) -> tuple[int, int]:
    """(in, out) of every rank in a ring all-reduce of ``nbytes``."""
    moved = 2 * (world - 1) * nbytes // world if world > 1 else 0
    return moved, moved


def owner_parts(layout: UnitLayout) -> list[tuple[int, int, int]]:
    """(owner, first, end) of each non-empty owner part of the matrix region, in layout order: an
    owner's matrices (or Q/K/V blocks) lie together, so one broadcast or reduce moves them all."""
    return [
        (r, *layout.matrix_range(r))
        for r in range(layout.world_size)
        if layout.matrix_range(r)[1] > layout.matrix_range(r)[0]
    ]


def tail_slice(layout: UnitLayout) -> int:
    """Elements of the largest tail slice: every rank's slice is padded to it for the all-gather and
    the reduce-scatter (the even split gives the first ``T % W`` ranks one element more)."""
    b = layout.tail_bounds
    return max(b[r + 1] - b[r] for r in range(layout.world_size))


def tail_geometry(layout: UnitLayout) -> tuple[int, list[int]] | None:
    """(first element, slice length per rank) of the tail in the packed gradient, where it follows the
    matrix region with rank r's slice at ``first + r * tail_slice`` (padded, so a reduce-scatter can
    take it); None without a tail."""
    if not layout.tail_numel:
        return None
    return layout.matrix_numel, [b - a for a, b in map(layout.tail_range, range(layout.world_size))]


def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


def _owner_collective_links(layout: UnitLayout, elsize: int, part_link) -> list[tuple[int, int]]:
    """(in, out) of every rank for one call per owner part (``part_link``: broadcast or reduce) plus one
    all-gather or reduce-scatter of the padded tail."""
    w = layout.world_size
    links = [(0, 0)] * w
    for owner, lo, hi in owner_parts(layout):
        links = [add(links[r], part_link((hi - lo) * elsize, r, owner, w)) for r in range(w)]
    if layout.tail_numel:
        links = [add(link, slices_link(tail_slice(layout) * elsize, w)) for link in links]
    return links


def gather_links(wire: UnitLayout, elsize: int) -> list[tuple[int, int]]:
    """(in, out) of every rank for one gather of a unit: a broadcast per owner part, one all-gather of
    the padded tail (``wire`` in the segment's elements: bytes for FP8 units)."""
    return _owner_collective_links(wire, elsize, broadcast_link)


def ring_reduce_links(layout: UnitLayout, elsize: int) -> list[tuple[int, int]]:
    """(in, out) of every rank for one reduction in ring order: a reduce per owner part into its
    owner, one reduce-scatter of the padded tail."""
    return _owner_collective_links(layout, elsize, reduce_link)


def zero3_bytes(numel: int, elsize: int, world: int) -> int:
    """ZeRO-3's bytes per rank, each way, for one all-gather or reduce-scatter of ``numel`` (unpadded)."""
    return (world - 1) * numel * elsize // world


def busiest(links: list[tuple[int, int]]) -> int:
    """The critical path of one call: the busiest rank's larger direction."""
    return max(max(link) for link in links)


def reduce_links(layout: UnitLayout, order: str, grad_elsize: int) -> list[tuple[int, int]]:
    """(in, out) of every rank for one reduction of a unit in ``order`` ('rank': fp32 partial sums)."""
    if order == "ring":
        return ring_reduce_links(layout, grad_elsize)
    return chain_links(owner_parts(layout), tail_geometry(layout), layout.world_size)


def padded_links(layout: UnitLayout, elsize: int) -> list[tuple[int, int]]:
    """(in, out) of every rank for the ``padded`` algorithm: one all-gather (reduce-scatter) of W
    segments, each padded to the largest."""
    w = layout.world_size
    return [slices_link(max(map(layout.segment_numel, range(w))) * elsize, w)] * w


def two_level_links(layout: UnitLayout, elsize: int, per_node: int, reduce: bool) -> list[tuple[int, int]]:
    """(in, out) of every rank for the ``two_level`` algorithm (runtime/algorithms.py), both levels summed:
    each owner part over the owner's rail (its local index's ranks, one a node) and inside every node,
    and the tail's slices over every rail, then inside every node (a reduction: the mirror)."""
    w = layout.world_size
    nodes, link = w // per_node, reduce_link if reduce else broadcast_link
    links = [(0, 0)] * w
    for r in range(w):
        node, local = divmod(r, per_node)
        for owner, lo, hi in owner_parts(layout):
            (o_node, o_local), n = divmod(owner, per_node), (hi - lo) * elsize
            links[r] = add(links[r], link(n, local, o_local, per_node)) if per_node > 1 else links[r]
            if nodes > 1 and local == o_local:
                links[r] = add(links[r], link(n, node, o_node, nodes))
        if layout.tail_numel:
            s = tail_slice(layout) * elsize
            links[r] = add(links[r], slices_link(s, nodes)) if nodes > 1 else links[r]
            links[r] = add(links[r], slices_link(nodes * s, per_node)) if per_node > 1 else links[r]
    return links


def algorithm_links(
    layout: UnitLayout, elsize: int, algorithm: str, per_node: int, reduce_order: str | None = None
) -> list[tuple[int, int]]:
    """(in, out) of every rank for one gather (``reduce_order`` None) or reduction by ``algorithm``
    (runtime/comm.py's names: parts, two_level, padded)."""
    if algorithm == "padded":
        return padded_links(layout, elsize)
    if algorithm == "two_level":
        return two_level_links(layout, elsize, per_node, reduce_order is not None)
    if reduce_order is None:
        return gather_links(layout, elsize)
    return reduce_links(layout, reduce_order, elsize)


@dataclass(frozen=True)
class UnitWire:
    """What the traffic figures need of one unit: its layout in elements, the layout the gather moves
    (bytes for FP8 units) with its element size, and whether it is trained."""

    layout: UnitLayout
    wire: UnitLayout
    wire_elsize: int
    param_elsize: int
    trained_numel: int
    algorithms: tuple[str, str] = ("parts", "parts")  # (gather, reduce): runtime/comm.py SegmentComm.algorithm
    per_node: int = 1  # shard ranks per node, for two_level


def iteration_links(units: list[UnitWire], num_micro: int, order: str, grad_elsize: int) -> dict[str, tuple[int, int]]:
    """Per phase of one iteration: (critical path, ZeRO-3's bytes). The critical path sums, over the
    unit operations, the busiest rank's larger direction; ZeRO-3's is what each rank moves each way
    for the same operations ((W - 1) / W of every parameter, unpadded, in the parameter dtype)."""
    phases = {"forward gather": [0, 0], "backward gather": [0, 0], "reduction": [0, 0]}
    for u in units:
        w = u.layout.world_size
        if not u.layout.numel or w == 1:
            continue
        gather = busiest(algorithm_links(u.wire, u.wire_elsize, u.algorithms[0], u.per_node))
        phases["forward gather"][0] += gather
        phases["forward gather"][1] += zero3_bytes(u.layout.numel, u.param_elsize, w)
        if u.trained_numel:
            phases["backward gather"][0] += gather
            phases["backward gather"][1] += zero3_bytes(u.trained_numel, u.param_elsize, w)
            reduce = algorithm_links(u.layout, grad_elsize, u.algorithms[1], u.per_node, order)
            phases["reduction"][0] += busiest(reduce)
            phases["reduction"][1] += zero3_bytes(u.trained_numel, grad_elsize, w)
    return {phase: (num_micro * a, num_micro * b) for phase, (a, b) in phases.items()}
