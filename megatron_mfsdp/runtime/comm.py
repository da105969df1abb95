"""Owner-segment communication behind one small interface: ``start_gather`` and
``start_reduce`` return a pending operation whose ``wait()`` gives the result. This is
the one place where the wire format, grouping and overlap are decided.

A unit's matrices live on a few owners, so anything where an owner talks to each peer in turn
(its matrix sent W - 1 times, or W - 1 copies of its gradient received) puts W x its segment on
one link. Every collective here is a ring that moves about one unit per rank instead, however
the owners split the unit (runtime/traffic.py has the per-rank bytes):

- gather: one pipelined ``broadcast`` per non-empty owner part (an owner's matrices lie together)
  plus one all-gather of the evenly split tail (each slice padded by at most one element), all as
  raw bytes, so any payload dtype travels (FP8 bytes and their fp32 scales included);
- reduce, ``ring`` order (the default on NCCL): one ``reduce`` per owner part into its owner plus
  one reduce-scatter of the padded tail, in the wire dtype, summed in NCCL's ring order; where the
  gradients already are in the wire dtype and the 1/W scale is a power of two, one ``reduce`` per
  whole matrix straight from its gradient, scaled by the owner as it lands (``start_reduce_grads``);
- reduce, ``rank`` order (the default elsewhere, gloo included): a chain in rank order
  (runtime/chain.py), bitwise the single-process reference's sum, fp32 partial sums.

On NCCL a unit's broadcasts (or reduces) go out as one group with one work handle, the tail's call
right after it on the same stream. The gradient is packed in layout order, so each owner part is
contiguous and the padded tail follows; no buffer is larger than a unit (plus the tail's padding).
With checks on, each collective goes with a small signature all-reduce (placement/verify.py),
verified in ``wait()`` before the data is read. With hybrid sharding the reduced segment is then
all-reduced over the replica group.

That is the ``parts`` algorithm. ``two_level`` (inside each node, then across nodes on rails, with the
node layout of node_levels.py) and ``padded`` (one all-gather / reduce-scatter of padded segments) are
in runtime/algorithms.py. The algorithm is chosen per unit and direction (``choose``), ``parts`` by
default; in ``rank`` order a unit's reduction stays the exact chain unless another is forced.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..compat.collectives import all_gather_single, reduce_scatter_single
from ..groups import ProcessGroups, group_rank, group_size
from ..node_levels import NodeLevels, single_level
from ..placement.layout import UnitLayout
from ..placement.verify import ALGORITHM_STRIDE, GATHER, REDUCE, start_signature
from .algorithms import LevelledCollectives, as_bytes
from .chain import CHUNK_BYTES, Chain
from .traffic import (
    FLAT,
    GATHER_OP,
    REDUCE_OP,
    REPLICA_OP,
    LinkCall,
    add,
    all_reduce_link,
    broadcast_link,
    owner_parts,
    reduce_link,
    slices_link,
    tail_geometry,
    tail_slice,
)

PHASES = ("forward", "backward", "reduce", "other")
REDUCE_ORDERS = ("auto", "rank", "ring")
PARTS, TWO_LEVEL, PADDED = "parts", "two_level", "padded"
ALGORITHMS = (PARTS, TWO_LEVEL, PADDED)


def resolve_reduce_order(order: str, backend: str) -> str:
    """``auto``: ``ring`` on NCCL (its reduces run pipelined in one group, overlapping backward; the
    chain would add between serial hops), ``rank`` elsewhere (gloo on CPU is where exactness is
    checked, and there the chain costs the same bytes)."""
    if order not in REDUCE_ORDERS:
        raise ValueError(f"unknown reduce order {order!r} (--mfsdp-reduce-order); choose one of {REDUCE_ORDERS}")
    if order != "auto":
        return order
    return "ring" if backend == "nccl" else "rank"


def param_runs_view(flat: torch.Tensor, runs: tuple[int, int, int, int]) -> torch.Tensor:
    """The elements of a flattened parameter that ``runs`` (``LocalPiece.runs``: first, run, stride,
    count) name, as a (count, run) view: a range of it, or a Q, K or V block's rows of every group."""
    first, run, stride, count = runs
    return flat.as_strided((count, run), (stride, 1), flat.storage_offset() + first)


class PendingGather:
    """A unit's full buffer being filled from every owner's segment. ``own``: (first, end) of this
    rank's matrix part when it was left out of the buffer (``start_gather(own_views=True)``): its
    elements are read from the segment instead; None when the buffer holds everything."""

    def __init__(self, full: torch.Tensor, works: list, finish=None, check=None, own=None):
        self.full, self._works, self._finish, self._check, self.own = full, works, finish, check, own

    def wait(self) -> torch.Tensor:
        if self._check is not None:  # before the data: a mismatched collective raises, not hangs
            self._check.verify()  # idempotent: a second wait() does not wait again
        for work in self._works:
            work.wait()
        self._works = []
        if self._finish is not None:
            self._finish()
            self._finish = None
        return self.full


class PendingReduce:
    """This rank's segment of a unit's gradient summed over the group, ready on ``wait()``.
    ``pieces``: where the finished sum lies, in segment order, each with the factor it still needs
    (tensor, alpha), for :meth:`add_to` to add without first joining them; without ``finish``, ``wait()``
    joins them."""

    def __init__(self, finish=None, works=(), check=None, replica=None, pieces=None):
        self._finish = finish if finish is not None else lambda: _joined(pieces)
        self._works, self._check, self._replica = list(works), check, replica
        self._pieces = pieces if replica is None else None  # a replica sum all-reduces the joined segment
        self._segment = None

    def _land(self) -> None:
        if self._check is not None:
            self._check.verify()
        for work in self._works:
            work.wait()
        self._works = []

    def add_to(self, target: torch.Tensor) -> None:
        """``target += `` this rank's reduced segment (fp32 sums, as ``wait()``'s): piece by piece
        where the pieces lie apart, which saves a copy of the segment per reduction."""
        if self._pieces is None or self._segment is not None:
            target.add_(self.wait())
            return
        self._land()
        at = 0
        for piece, alpha in self._pieces:
            target[at : at + piece.numel()].add_(piece, alpha=alpha)
            at += piece.numel()

    def wait(self) -> torch.Tensor:
        if self._segment is not None:
            return self._segment
        self._land()
        segment = self._finish()
        if self._replica is not None and segment.numel():
            self._replica(segment)
        self._segment, self._finish = segment, None
        return segment


class _Route:
    """Where each piece of a unit lies in the packed gradient: the matrix region in layout order
    (each owner part contiguous), then the tail with rank r's slice at ``r * slice`` (padded)."""

    def __init__(self, layout: UnitLayout, world: int):
        m, self.slice = layout.matrix_numel, tail_slice(layout)
        self.numel = m + world * self.slice if layout.tail_numel else m
        # (parameter name, its elements (LocalPiece.runs), numel, offset in the packed gradient)
        self.copies = []
        for r in range(world):
            mine = layout.matrix_range(r)[1] - layout.matrix_range(r)[0]
            for p in layout.local_pieces(r):
                if p.segment_offset < mine:  # a matrix piece: where it lies in the full buffer
                    at = p.slot.offset + p.param_offset - p.slot.param_start
                else:
                    at = m + r * self.slice + p.segment_offset - mine
                self.copies.append((p.slot.param_name, p.runs(), p.numel, at))
        self.covers_all = sum(c[2] for c in self.copies) == layout.numel  # every element has a piece
        self.padding = [  # the tail slices' padding elements, zero on the wire
            (m + r * self.slice + b - a, m + (r + 1) * self.slice)
            for r, (a, b) in enumerate(map(layout.tail_range, range(world)))
            if layout.tail_numel and b - a < self.slice
        ]


class SegmentComm(LevelledCollectives):
    """Owner-segment collectives of one shard group (and its replica group).

        ``traffic[phase]`` holds [bytes in, bytes out] of this rank, each call charged as NCCL's ring
        algorithms move it (runtime/traffic.py); ``log``, when a list, gets a :class:`LinkCall` per
        unit operation (tests and benchmarks set it). ``transient`` is the largest buffer (bytes) a
        gather or reduction has allocated. The groups are ``groups``' dense pair (``dp_shard``,
        ``replica``), or without ``groups`` a shard domain's ``shard`` and ``replica`` (runtime/domain.py).
    ``levels``: the shard group's node layout (node_levels.py; default all on one node), which ``two_level``
    runs on; ``algorithms``: unit index -> (gather, reduce) algorithm, see :meth:`choose`."""

    def __init__(
        self,
        groups: ProcessGroups | None = None,
        verify: bool = True,
        device=None,
        reduce_order: str = "auto",
        *,
        shard=None,
        replica=None,
        levels: NodeLevels | None = None,
        algorithms: Mapping[int, tuple[str, str]] | None = None,
    ):
        if groups is not None:
            shard, replica = groups.dp_shard, groups.replica
        self.group, self.replica = shard, replica
        self.rank, self.world = group_rank(shard), group_size(shard)
        self.verify = verify and self.world > 1
        self.device = device
        backend = dist.get_backend(self.group) if self.world > 1 else "none"
        self.reduce_order = resolve_reduce_order(reduce_order, backend)
        # One NCCL group per unit operation; the fake backend (large-W tests) takes the same path.
        self.grouped = backend in ("nccl", "fake")
        self.traffic = {phase: [0, 0] for phase in PHASES}
        self.log: list[LinkCall] | None = None
        self.transient = 0
        self.chunk_bytes = CHUNK_BYTES  # of the rank-ordered chain's messages
        self.routes: dict[int, _Route] = {}  # per unit index; they depend on the layout alone, not the rank
        self.levels = levels if levels is not None else single_level(shard)
        if self.levels.world != self.world:
            raise ValueError(f"node levels of {self.levels.world} ranks for a shard group of {self.world}")
        self.algorithms: dict[int, tuple[str, str]] = {}
        self.forced: tuple[str | None, str | None] = (None, None)
        self.choose(algorithms or {})

    def choose(self, algorithms: Mapping[int, tuple[str, str]], force: tuple[str | None, str | None] = (None, None)):
        """Set the (gather, reduce) algorithm of each unit index (others: ``parts``), and ``force``
        one for every unit (None: per unit), for tests and benchmarks. In ``rank`` order a per-unit
        reduce other than ``parts`` raises: the exact chain is replaced only when forced."""
        for name in [a for pair in algorithms.values() for a in pair] + [a for a in force if a is not None]:
            if name not in ALGORITHMS:
                raise ValueError(f"unknown collective algorithm {name!r}; choose one of {ALGORITHMS}")
        if self.reduce_order == "rank" and any(r != PARTS for _, r in algorithms.values()):
            raise ValueError(
                "reduce order rank is the exact chain: a per-unit reduce algorithm other than parts needs "
                "reduce order ring (or force it for every unit)"
            )
        self.algorithms, self.forced = dict(algorithms), tuple(force)

    def algorithm(self, unit: int, reduce: bool) -> str:
        """The algorithm of unit ``unit``'s gather (``reduce`` False) or reduction."""
        return self.forced[reduce] or self.algorithms.get(unit, (PARTS, PARTS))[reduce]

    def route(self, layout: UnitLayout) -> _Route:
        if layout.index not in self.routes:
            self.routes[layout.index] = _Route(layout, self.world)
        return self.routes[layout.index]

    def _charge(self, phase: str, unit: int, op: str, link: tuple[int, int], level: str = FLAT) -> None:
        self.traffic[phase][0] += link[0]
        self.traffic[phase][1] += link[1]
        if self.log is not None:
            self.log.append(LinkCall(phase, unit, op, *link, level))

    def _buffer(self, numel: int, dtype, device) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=device)
        self.transient = max(self.transient, t.numel() * t.element_size())
        return t

    def _owner_calls(self, call, parts, device) -> list:
        """One call per owner part (a broadcast or a reduce: ``call(first, end, owner)``) over the shard
        group, grouped as :meth:`_grouped` says."""
        return self._grouped(self.group, lambda owner, lo, hi: call(lo, hi, owner), parts, device)

    def _grouped(self, group, call, parts, device) -> list:
        """``call(root, first, end)`` for each of ``parts`` over ``group``, as one NCCL group with one
        work handle where the backend groups (torch's ``_coalescing_manager`` with a device: each call
        goes to the backend inside one ncclGroupStart/End), one work each elsewhere. The tail's
        all-gather or reduce-scatter follows outside the group: inside it, torch records that call on
        its separate "fast path" and issues it as a coalesced call of its own at exit."""
        if not self.grouped:
            return [call(root, lo, hi) for root, lo, hi in parts]
        if not parts:
            return []
        device = torch.device("cpu") if device.type == "meta" else device  # shapes only: the fake backend's at scale
        with dist._coalescing_manager(group, device, async_ops=True) as cm:
            for root, lo, hi in parts:
                call(root, lo, hi)
        return [w for w in cm.works if w is not None]

    # ----------------------------------------------------------------- gather
    def start_gather(
        self, layout: UnitLayout, segment: torch.Tensor, phase: str = "other", own_views: bool = False
    ) -> PendingGather:
        """Start filling the unit's whole flat buffer from every owner's segment (``layout`` in the
        segment's elements: a byte layout for FP8 units). ``own_views``: with ``parts``, leave this
        rank's matrix part out of the buffer (its broadcast sends from the segment) for a caller that
        views it in the segment: a copy of up to a whole unit saved per gather (``PendingGather.own``)."""
        algorithm = self.algorithm(layout.index, False)
        check = self._signature(layout, GATHER, algorithm)
        full = self._buffer(layout.numel, segment.dtype, segment.device)
        (m0, m1), (t0, t1) = layout.matrix_range(self.rank), layout.tail_range(self.rank)
        own = (m0, m1) if own_views and algorithm == PARTS and m1 > m0 else None
        if own is None:
            full[m0:m1].copy_(segment[: m1 - m0])
        if self.world == 1:
            full[t0:t1].copy_(segment[m1 - m0 :])
            return PendingGather(full, [], own=own)
        if algorithm == PADDED:
            return PendingGather(full, *self.padded_gather(layout, full, segment, phase), check)
        link, elsize, parts = (0, 0), segment.element_size(), owner_parts(layout)
        tail = self._tail_buffers(layout, full, segment[m1 - m0 :]) if layout.tail_numel else None
        if algorithm == TWO_LEVEL:
            works = self.two_level_gather(layout, full, tail, phase, check)
            return PendingGather(full, works, tail[2] if tail else None, check)

        def broadcast(lo, hi, owner):
            data = segment[: hi - lo] if owner == self.rank and own is not None else full[lo:hi]
            return dist.broadcast(as_bytes(data), group=self.group, group_src=owner, async_op=True)

        works = self._owner_calls(broadcast, parts, segment.device)
        for owner, lo, hi in parts:
            link = add(link, broadcast_link((hi - lo) * elsize, self.rank, owner, self.world))
        if tail is not None:
            out, mine, _ = tail
            works.append(all_gather_single(as_bytes(out), as_bytes(mine), group=self.group, async_op=True))
            link = add(link, slices_link(mine.numel() * elsize, self.world))
        self._charge(phase, layout.index, GATHER_OP, link)
        return PendingGather(full, works, tail[2] if tail else None, check, own)

    def _tail_buffers(self, layout: UnitLayout, full: torch.Tensor, own: torch.Tensor):
        """(output, this rank's input, finish) of the tail's all-gather: straight into the full buffer
        when the slices are even, else into a staging buffer of padded slices copied into place by
        ``finish`` after the wait. The input is never a view of the output (in-place gathers differ
        between backends)."""
        s, m = tail_slice(layout), layout.matrix_numel
        if layout.tail_numel == s * self.world:
            return full[m:], own, None
        staging = self._buffer(s * self.world, full.dtype, full.device)
        mine = torch.zeros(s, dtype=full.dtype, device=full.device)  # the padding element is zero
        mine[: own.numel()].copy_(own)

        def finish():
            for r in range(self.world):
                t0, t1 = layout.tail_range(r)
                full[t0:t1].copy_(staging[r * s : r * s + t1 - t0])

        return staging, mine, finish

    def _signature(self, layout: UnitLayout, op: int, algorithm: str = PARTS):
        """The unit's signature all-reduce, started before its collective (None without checks); the
        algorithm is part of it, so ranks that chose differently raise instead of hanging."""
        if not self.verify:
            return None
        op += ALGORITHM_STRIDE * ALGORITHMS.index(algorithm)
        return start_signature(self.group, layout.index, op, layout.numel, self.device)

    # ----------------------------------------------------------------- reduce
    def pack_grads(self, layout: UnitLayout, grads: dict, dtype, scale: float, first: int = 0) -> torch.Tensor:
        """This rank's contribution to the unit's gradient, scaled, in layout order with the tail
        slices padded (``_Route``), from element ``first`` of that order on; a parameter without a
        gradient contributes zeros. The scale is applied as each gradient is copied when dtypes match
        (one pass instead of copy, then scale; the same products), and only uncovered elements are zeroed."""
        route = self.route(layout)
        copies = [c for c in route.copies if c[3] >= first]
        complete = route.covers_all and all(grads.get(name) is not None for name, *_ in copies)
        out = self._buffer(route.numel - first, dtype, self.device)
        if not complete:
            out.zero_()
        for lo, hi in route.padding if complete else ():
            out[lo - first : hi - first].zero_()
        for name, runs, numel, at in copies:
            grad = grads.get(name)
            if grad is None:
                continue
            at -= first
            src, dst = param_runs_view(grad.reshape(-1), runs), out[at : at + numel].view(runs[3], runs[1])
            if scale == 1.0:
                dst.copy_(src)
            elif src.dtype == dtype:
                torch.mul(src, scale, out=dst)
            else:
                dst.copy_(src).mul_(scale)
        return out

    def start_reduce_grads(self, layout: UnitLayout, grads: dict, dtype, scale: float, direct: bool = True):
        """``start_reduce(layout, pack_grads(...))``, or, with ``parts`` in ring order and a power-of-two
        ``scale`` (the 1/W average at W = 2, 4, 8, ...), each whole matrix's gradient reduced where it
        lies, unscaled, and only the tail packed: a copy of the unit's gradient saved per reduction. The
        owner scales its sums as they land (:meth:`PendingReduce.add_to`). Scaling by a power of two is
        exact, so only the ring's order of summation can differ from the packed reduction's (at W = 2
        nothing does). ``direct`` False: the gradients are views of a buffer freed right after (MainGrads)."""
        matrices = self._direct_matrices(layout, grads, dtype, scale) if direct else None
        if matrices is None:
            return self.start_reduce(layout, self.pack_grads(layout, grads, dtype, scale))
        check = self._signature(layout, REDUCE, PARTS)
        by_first = {lo: g for _, lo, _, g in matrices}

        def reduce(owner, lo, hi):
            return dist.reduce(by_first[lo], group=self.group, group_dst=owner, async_op=True)

        device = matrices[0][3].device
        works = self._grouped(self.group, reduce, [(owner, lo, hi) for owner, lo, hi, _ in matrices], device)
        pieces = [(g, scale) for owner, _, _, g in matrices if owner == self.rank]
        if layout.tail_numel:
            route, m = self.route(layout), layout.matrix_numel
            tail, out_tail = self.pack_grads(layout, grads, dtype, scale, m), self._buffer(route.slice, dtype, device)
            works.append(reduce_scatter_single(out_tail, tail, group=self.group, async_op=True))
            t0, t1 = layout.tail_range(self.rank)
            pieces.append((out_tail[: t1 - t0], 1.0))
        self._charge("reduce", layout.index, REDUCE_OP, self._ring_reduce_link(layout, matrices[0][3].element_size()))
        return PendingReduce(works=works, check=check, pieces=pieces)

    def _ring_reduce_link(self, layout: UnitLayout, elsize: int) -> tuple[int, int]:
        """(in, out) of this rank in a unit's ``parts`` ring reduction: a reduce per owner part into its
        owner, then the tail's reduce-scatter."""
        link = (0, 0)
        for owner, lo, hi in owner_parts(layout):
            link = add(link, reduce_link((hi - lo) * elsize, self.rank, owner, self.world))
        if layout.tail_numel:
            link = add(link, slices_link(self.route(layout).slice * elsize, self.world))
        return link

    def _direct_matrices(self, layout: UnitLayout, grads: dict, dtype, scale: float):
        """(owner, first, end, flat gradient) of each matrix, in layout order, where
        :meth:`start_reduce_grads` may reduce them unpacked; else None."""
        if self.world == 1 or self.replica is not None or self.reduce_order != "ring" or not layout.matrix_numel:
            return None
        if self.algorithm(layout.index, True) != PARTS or scale <= 0 or math.frexp(scale)[0] != 0.5:
            return None
        out = []
        for slot in sorted(layout.slots, key=lambda s: s.offset):
            if slot.offset >= layout.matrix_numel:
                continue
            g = grads.get(slot.param_name)
            if slot.param is not None or g is None or g.dtype != dtype or g.numel() != slot.numel:
                return None  # a Q/K/V block, a missing gradient or another dtype: packed
            if not g.is_contiguous():  # reduced in place through a flat view
                return None
            owner = bisect.bisect_right(layout.matrix_bounds, slot.offset) - 1
            out.append((owner, slot.offset, slot.offset + slot.numel, g.view(-1)))
        return out

    def start_reduce(self, layout: UnitLayout, packed: torch.Tensor) -> PendingReduce:
        """Start summing ``packed`` (this rank's contribution from ``pack_grads``) over the group;
        ``wait()`` returns this rank's segment of the sum in fp32."""
        algorithm = self.algorithm(layout.index, True)
        check = self._signature(layout, REDUCE, algorithm)
        route, replica = self.route(layout), self._replica_sum(layout)
        if self.world == 1:
            own = [(piece, 1.0) for piece in self._own_pieces(layout, packed, route)]
            return PendingReduce(replica=replica, pieces=own)
        if algorithm == PARTS and self.reduce_order == "rank":
            return self._chain_reduce(layout, packed, check, replica)
        if algorithm == PADDED:
            works, out = self.padded_reduce(layout, packed, route.slice)
            return PendingReduce(lambda: out[: layout.segment_numel(self.rank)].float(), works, check, replica)
        out_tail = self._buffer(route.slice, packed.dtype, packed.device) if layout.tail_numel else None
        if algorithm == TWO_LEVEL:
            works = self.two_level_reduce(layout, packed, out_tail, check)
            return self._pending_parts(layout, packed, out_tail, works, check, replica)

        def reduce(lo, hi, owner):
            return dist.reduce(packed[lo:hi], group=self.group, group_dst=owner, async_op=True)

        works = self._owner_calls(reduce, owner_parts(layout), packed.device)
        if out_tail is not None:
            m = layout.matrix_numel
            works.append(reduce_scatter_single(out_tail, packed[m:], group=self.group, async_op=True))
        self._charge("reduce", layout.index, REDUCE_OP, self._ring_reduce_link(layout, packed.element_size()))

        return self._pending_parts(layout, packed, out_tail, works, check, replica)

    def _pending_parts(self, layout: UnitLayout, packed: torch.Tensor, out_tail, works, check, replica):
        """A reduction that sums this rank's matrix part in place in ``packed`` and its tail slice into
        ``out_tail``: those two pieces, joined in fp32 by ``wait()``."""
        m0, m1 = layout.matrix_range(self.rank)
        t = layout.tail_range(self.rank)
        pieces = [(packed[m0:m1], 1.0)] + ([(out_tail[: t[1] - t[0]], 1.0)] if out_tail is not None else [])
        return PendingReduce(works=works, check=check, replica=replica, pieces=pieces)

    def _own_pieces(self, layout: UnitLayout, packed: torch.Tensor, route: _Route) -> list[torch.Tensor]:
        """One rank's whole segment of ``packed``: its matrix part and its tail slice."""
        m0, m1 = layout.matrix_range(self.rank)
        t = layout.tail_range(self.rank)
        lo = layout.matrix_numel + self.rank * route.slice
        return [packed[m0:m1], packed[lo : lo + t[1] - t[0]]]

    def _chain_reduce(self, layout: UnitLayout, packed: torch.Tensor, check, replica):
        """The rank-ordered chain (runtime/chain.py), run in ``wait()``: fp32 partial sums, this rank's
        contribution summed into in place (a bf16 wire is widened first, as the reference sums)."""
        tail = tail_geometry(layout)

        def finish():
            work = packed
            if packed.dtype != torch.float32:
                work = self._buffer(packed.numel(), torch.float32, packed.device).copy_(packed)
            result = self._buffer(layout.segment_numel(self.rank), torch.float32, packed.device)
            args = (owner_parts(layout), tail, self.rank, self.world, self.group, result, self.chunk_bytes)
            chain = Chain(work, *args)
            chain.run()
            self._charge("reduce", layout.index, REDUCE_OP, tuple(chain.moved))
            return result

        return PendingReduce(finish, (), check, replica)

    def _replica_sum(self, layout: UnitLayout):
        """With hybrid sharding: the all-reduce of a reduced segment over the replica group."""
        if self.replica is None:
            return None
        world = dist.get_world_size(self.replica)

        def replica(segment: torch.Tensor) -> None:
            dist.all_reduce(segment, group=self.replica)
            self._charge("reduce", layout.index, REPLICA_OP, all_reduce_link(segment.numel() * 4, world))

        return replica


def _joined(pieces) -> torch.Tensor:
    """A reduction's pieces (tensor, alpha) joined into one fp32 segment."""
    return torch.cat([piece.float() if alpha == 1.0 else piece.float() * alpha for piece, alpha in pieces])


def all_reduce_flat(tensors: Sequence[torch.Tensor], group) -> None:
    """Sum tensors over a group in place with one all-reduce of their concatenation."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
