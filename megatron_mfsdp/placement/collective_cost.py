"""Which owner-collective algorithm each unit uses, gather and reduction apart, chosen by a
latency-bandwidth cost model from the unit's layout alone, so every rank chooses the same.

A unit's gather (its reduction mirrors it) can run as (per-rank bytes: runtime/traffic.py):

- ``parts``: one pipelined ring broadcast per non-empty owner part plus one ring all-gather of the
  evenly split tail. Every rank moves about one unit, but k owner parts pay k + 1 ring latencies
  of about W hops each;
- ``two_level``: each owner part broadcast over the owner's rail group (one rank per node, the
  owner among them), then inside every node: about W/n network hops plus n NVLink hops per part
  instead of W network hops, for a second pass of the bytes over NVLink. The rails are separate
  groups on separate NICs, so parts whose owners sit at different local indices cross the network
  at once: the network stage costs the busiest rail's parts. The tail goes over every rail (its
  slices), then inside every node (runtime/algorithms.py);
- ``padded``: one all-gather (reduce-scatter) of every rank's segment padded to the largest: one
  ring latency, W x the largest segment in bytes. It wins for small units and small W.

Each call costs ``call + base + hops x hop latency + bytes / bus bandwidth`` with the hop latency
and bandwidth of the level it crosses (NVIDIA NCCL's tuning model, src/graph/tuning.cc: a ring
all-gather takes W - 1 steps of which nodes - 1 are on the network, intra-node hops slowed 1.8x
when the ring spans nodes; a ring broadcast or reduce takes W steps at the network's hop latency
once the communicator spans nodes). ``benchmarks/scaling_model.py`` charges its collectives with
these same functions and constants. The signature check of each owner collective
(placement/verify.py, a 48-byte all-reduce: NCCL's tree, :func:`tree_latency`) is the same for every
algorithm and is left out of the choice.

With reduce order ``rank`` (gloo's default) the reduction is the exact rank-ordered chain; ``auto``
keeps it (an exact sum is never replaced silently) and only a forced algorithm replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .layout import UnitLayout

PARTS, TWO_LEVEL, PADDED = "parts", "two_level", "padded"
ALGORITHMS = (PARTS, TWO_LEVEL, PADDED)
"""The algorithms of one unit and direction, in tie-break order: on equal predicted time the
earlier wins (``parts``, today's calls, first)."""

MODES = ("auto", "parts", "two-level", "padded")
"""--mfsdp-collectives: ``auto`` chooses by cost; the others force one algorithm everywhere."""
MODE_ALGORITHM = {"parts": PARTS, "two-level": TWO_LEVEL, "padded": PADDED}

GATHER_DIRECTION, REDUCE_DIRECTION = "gather", "reduce"
CHAIN = "chain"  # how the table names a ``parts`` reduction run as the rank-ordered chain

CHOICE_MARGIN = 0.1
"""A later algorithm replaces an earlier one (``parts`` first) only when predicted faster by more than
this, relative: the constants are estimates, and a change of algorithm is not free to be wrong. On 4
gloo ranks a padded gather the model called 3.5% faster measured 4% slower (benchmarks/bench_end_to_end.py);
two_level's gains at scale are 2x and more."""

# NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel): ring/LL base latency
# 3.6 us, hop latency 0.47 us over NVLink and 2.7 us over the network; intra-node hops count 1.8x
# when a ring spans nodes. Bandwidths are the paper's cluster (A100-80GB, DGX A100, 8x HDR per node).
NCCL_BASE_LAT_S = 3.6e-6
NVLINK_HOP_S = 0.47e-6
NET_HOP_S = 2.7e-6
SPANNING_INTRA_HOP_FACTOR = 1.8
NVLINK_BUS_BW = 230e9  # assumed: just under NCCL's 235 GB/s clamp for A100 (NVSwitch), bytes/s per GPU
IB_BUS_BW = 23e9  # assumed: 8x HDR 200 Gb/s per node = 25 GB/s per GPU, 92% of it reached by NCCL rings
GPU_CALL_OVERHEAD_S = 10e-6  # assumed: host cost of one torch.distributed call (Python + NCCL enqueue)
# gloo on CPU over loopback: one level. Rounded from benchmarks/scaling_model.py --quick's calibration
# on this 2-core machine (2 processes: broadcast latency 139 us, 0.3-0.7 GB/s); assumed, not measured per run.
GLOO_CALL_S = 20e-6  # assumed: Python + gloo dispatch of one call
GLOO_HOP_S = 150e-6  # one loopback ring step (a TCP round trip and a thread hand-off)
GLOO_BUS_BW = 0.5e9  # loopback bytes/s per rank reached by gloo's ring
CHAIN_CHUNK_BYTES = 4 << 20  # runtime/chain.py CHUNK_BYTES (the chain's message size); a test holds them equal


@dataclass(frozen=True)
class Level:
    """One level of the network: the latency of one ring step and the bus bandwidth per rank."""

    hop_s: float
    bus_bw: float


@dataclass(frozen=True)
class CostConstants:
    """The constants of the model; override any of them with ``dataclasses.replace``."""

    call_s: float  # host cost of one collective call
    base_s: float  # base latency of one collective
    intra: Level  # inside a node (NVLink)
    inter: Level  # between nodes (the rails)
    spanning_intra_factor: float = SPANNING_INTRA_HOP_FACTOR  # intra hops of a ring that spans nodes
    chain_chunk_bytes: int = CHAIN_CHUNK_BYTES
    duplex: bool = True
    """Links carry both directions at once (NVLink, InfiniBand). False on gloo over loopback, where the
    CPU copies every byte sent and every byte received: a call costs a rank's bytes in plus out."""
    rail_bus_bw: float | None = None
    """A rail group's bandwidth per rank (one GPU a node, so its own NIC); None: ``inter``'s. Set it below
    ``inter.bus_bw`` where a flat ring's channels spread over a node's NICs (NCCL's multi-channel rings)."""


NCCL_A100 = CostConstants(
    GPU_CALL_OVERHEAD_S, NCCL_BASE_LAT_S, Level(NVLINK_HOP_S, NVLINK_BUS_BW), Level(NET_HOP_S, IB_BUS_BW)
)
GLOO_CPU = CostConstants(
    GLOO_CALL_S, 0.0, Level(GLOO_HOP_S, GLOO_BUS_BW), Level(GLOO_HOP_S, GLOO_BUS_BW), 1.0, duplex=False
)


def constants_for(backend: str) -> CostConstants:
    """The default constants of a torch.distributed backend: NCCL's on ``nccl``, gloo's elsewhere."""
    return NCCL_A100 if backend == "nccl" else GLOO_CPU


@dataclass(frozen=True)
class Topology:
    """W ranks of one collective, ``per_node`` of them on each node (the last node may hold fewer)."""

    world: int
    per_node: int

    def __post_init__(self):
        if self.world < 1 or self.per_node < 1:
            raise ValueError(f"a topology needs world >= 1 and ranks per node >= 1, got {self.world}, {self.per_node}")

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.per_node)

    @property
    def local(self) -> int:
        """Ranks of the collective on one (full) node."""
        return min(self.world, self.per_node)

    def level(self, c: CostConstants) -> Level:
        """The level a flat ring over all W crosses: the network once it spans nodes."""
        return c.inter if self.nodes > 1 else c.intra


def ring_latency(c: CostConstants, t: Topology, steps: int) -> float:
    """Latency of a ring all-gather / reduce-scatter / all-reduce of ``steps`` steps: the host call,
    the base, nodes - 1 network steps and the rest inside nodes."""
    spans = t.nodes > 1
    network = min(steps, t.nodes - 1) if spans else 0
    intra_hop = c.intra.hop_s * (c.spanning_intra_factor if spans else 1.0)
    return c.call_s + c.base_s + (steps - network) * intra_hop + network * c.inter.hop_s


def tree_latency(c: CostConstants, t: Topology) -> float:
    """A small all-reduce on NCCL's tree (tuning.cc: 2 x (intra-node depth x NVLink hop + log2 nodes x
    network hop)), as the owner-collective signature check runs."""
    if t.world == 1:
        return 0.0
    depth = (t.local - 1) * c.intra.hop_s + math.ceil(math.log2(t.nodes)) * c.inter.hop_s
    return c.call_s + c.base_s + 2 * depth


def rooted_time(c: CostConstants, t: Topology, nbytes: float) -> float:
    """One pipelined ring broadcast (or reduce) of ``nbytes``: W steps at the hop latency of the
    level the ring crosses, and the bytes once through every rank."""
    if t.world == 1:
        return 0.0
    level = t.level(c)
    copies = 1 if c.duplex or t.world == 2 else 2  # not duplex: a middle rank receives and forwards
    return c.call_s + c.base_s + t.world * level.hop_s + copies * nbytes / level.bus_bw


def slices_time(c: CostConstants, t: Topology, slice_bytes: float) -> float:
    """One ring all-gather (or reduce-scatter) of W slices of ``slice_bytes``: each rank moves W - 1."""
    if t.world == 1:
        return 0.0
    copies = 1 if c.duplex else 2  # not duplex: each rank's W - 1 slices out and W - 1 in
    return ring_latency(c, t, t.world - 1) + copies * (t.world - 1) * slice_bytes / t.level(c).bus_bw


def all_reduce_time(c: CostConstants, t: Topology, nbytes: float) -> float:
    """One ring all-reduce of ``nbytes``: 2 (W - 1) steps, 2 (W - 1) / W of the bytes each way."""
    if t.world == 1:
        return 0.0
    return ring_latency(c, t, 2 * (t.world - 1)) + 2 * nbytes * (t.world - 1) / t.world / t.level(c).bus_bw


def chain_time(c: CostConstants, t: Topology, nbytes: float, max_segment_bytes: float) -> float:
    """The rank-ordered chain (runtime/chain.py): the packed gradient in C chunks through W - 1 links
    (C + W - 2 pipelined steps, each a send/recv pair: two calls, a base and a hop latency, a chunk's
    bytes), then one step handing each owner its summed segment."""
    if t.world == 1:
        return 0.0
    level = t.level(c)
    chunks = max(1, math.ceil(nbytes / c.chain_chunk_bytes))
    step = 2 * c.call_s + c.base_s + level.hop_s + nbytes / chunks / level.bus_bw
    handoff = c.call_s + c.base_s + level.hop_s + max_segment_bytes / level.bus_bw
    return (chunks + t.world - 2) * step + handoff


@dataclass(frozen=True)
class UnitShape:
    """What the cost of a unit's collectives depends on, in elements."""

    parts: tuple[int, ...]  # each non-empty owner part, in layout order
    tail_slice: int  # the largest tail slice (every slice is padded to it); 0 without a tail
    max_segment: int  # the largest rank segment (matrix part + tail slice)
    numel: int
    owners: tuple[int, ...] = ()  # the group rank owning each part (empty: every part on its own rail)

    @classmethod
    def of(cls, layout: UnitLayout) -> UnitShape:
        w = layout.world_size
        ranges = [(r, *layout.matrix_range(r)) for r in range(w)]
        parts = tuple((r, hi - lo) for r, lo, hi in ranges if hi > lo)
        b = layout.tail_bounds
        tail = max(b[r + 1] - b[r] for r in range(w)) if layout.tail_numel else 0
        sizes, owners = tuple(n for _, n in parts), tuple(r for r, _ in parts)
        return cls(sizes, tail, max(map(layout.segment_numel, range(w))), layout.numel, owners)


def algorithm_time(algorithm: str, u: UnitShape, t: Topology, elsize: int, c: CostConstants) -> float:
    """Predicted seconds of one gather (or reduction: the mirror, the same time) of unit ``u``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if t.world == 1:
        return 0.0
    if algorithm == PADDED:
        return slices_time(c, t, u.max_segment * elsize)
    if algorithm == TWO_LEVEL and t.nodes > 1 and t.local > 1:
        return two_level_time(u, t, elsize, c)
    tail = slices_time(c, t, u.tail_slice * elsize) if u.tail_slice else 0.0
    return sum(rooted_time(c, t, n * elsize) for n in u.parts) + tail


def two_level_time(u: UnitShape, t: Topology, elsize: int, c: CostConstants) -> float:
    """The network stage (each rail its own owners' broadcasts, the rails at once: the busiest rail's;
    the tail's slices over every rail), then the node stage (every part and the tail's node blocks
    over NVLink); a reduction is the mirror, the same time."""
    nodes, local = Topology(t.nodes, 1), Topology(t.local, t.local)  # a rail: one rank a node; a node
    if c.rail_bus_bw is not None:
        c = replace(c, inter=Level(c.inter.hop_s, c.rail_bus_bw))
    rails: dict[int, float] = {}
    for i, n in enumerate(u.parts):
        rail = u.owners[i] % t.per_node if u.owners else i
        rails[rail] = rails.get(rail, 0.0) + rooted_time(c, nodes, n * elsize)
    network = max(rails.values(), default=0.0)
    node = sum(rooted_time(c, local, n * elsize) for n in u.parts)
    if u.tail_slice:
        network += slices_time(c, nodes, u.tail_slice * elsize)
        node += slices_time(c, local, t.nodes * u.tail_slice * elsize)
    return network + node


def algorithm_times(u: UnitShape, t: Topology, elsize: int, c: CostConstants) -> tuple[float, ...]:
    """Predicted seconds of each algorithm, in ALGORITHMS order."""
    return tuple(algorithm_time(a, u, t, elsize, c) for a in ALGORITHMS)


def fastest(times: Sequence[float]) -> str:
    """The algorithm of least predicted time (``times`` in ALGORITHMS order); a later one must be
    faster by more than CHOICE_MARGIN to win, so near-ties go to the earlier (``parts`` first)."""
    best = 0
    for i in range(1, len(ALGORITHMS)):
        if times[i] < times[best] * (1 - CHOICE_MARGIN):
            best = i
    return ALGORITHMS[best]
