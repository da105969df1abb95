"""Owner-segment communication behind one small interface: ``start_gather`` and
``start_reduce`` return a pending operation whose ``wait()`` gives the result. This is
the one place where the wire format, coalescing and overlap are decided.

Segments are uneven and may be empty, so nothing here pads a rank up to the largest
segment: every collective carries exactly the unit's bytes. Coalesced (the default), a
unit costs one collective to gather and one to reduce:

- gather: every rank's segment goes to every other rank as raw bytes (so any payload
  dtype travels, FP8 bytes and their fp32 scales included): on NCCL one batch of
  point-to-point ops received straight into the full buffer, on gloo one
  ``all_to_all_single`` with uneven splits (gloo has no coalescing of p2p ops);
- reduce: one ``all_to_all_single`` of the gradient packed in segment order (rank 0's
  segment, rank 1's, ...), so each owner receives W rows of exactly its own segment.

``coalesce=False`` keeps the per-owner path (one broadcast per non-empty owner part, one
all-to-all per region) for comparison (benchmarks/bench_comm.py).

With checks on, each collective goes with a small signature all-gather (placement/verify.py),
verified in ``wait()`` before the data is read.

The owner sums the W contributions itself, in rank order and in fp32, so the result does
not depend on the backend's reduction tree or the wire dtype: the same sum a single
process computes. With hybrid sharding the reduced segment is then all-reduced over the
replica group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..groups import ProcessGroups
from ..placement.layout import UnitLayout
from ..placement.verify import GATHER, REDUCE, start_signature

PHASES = ("forward", "backward", "reduce", "other")


def param_runs_view(flat: torch.Tensor, runs: tuple[int, int, int, int]) -> torch.Tensor:
    """The elements of a flattened parameter that ``runs`` (``LocalPiece.runs``: first, run, stride,
    count) name, as a (count, run) view: a range of it, or a Q, K or V block's rows of every group."""
    first, run, stride, count = runs
    return flat.as_strided((count, run), (stride, 1), flat.storage_offset() + first)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor of any dtype (what the gather moves)."""
    return t.reshape(-1).view(torch.uint8)


class PendingGather:
    """A unit's full buffer being filled from every owner's segment."""

    def __init__(self, full: torch.Tensor, works: list, finish=None, check=None):
        self.full, self._works, self._finish, self._check = full, works, finish, check

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
    """The contributions of every rank to this rank's segment, summed on ``wait()``."""

    def __init__(self, contributions: list[torch.Tensor], replica_group, works=(), keep=None, check=None):
        self._contributions, self._replica = contributions, replica_group
        self._works, self._keep = list(works), keep  # keep: the send buffer, alive until the wire is done
        self._check = check

    def wait(self) -> torch.Tensor:
        if self._check is not None:
            self._check.verify()
        for work in self._works:
            work.wait()
        self._works, self._keep = [], None
        summed = []
        for region in self._contributions:  # [world, numel]: rank r's contribution in row r
            total = region[0].float()  # the owner sums in fp32 even when the wire carries bf16
            total = total.clone() if total.data_ptr() == region[0].data_ptr() else total
            for r in range(1, region.shape[0]):
                total.add_(region[r])
            summed.append(total)
        segment = summed[0] if len(summed) == 1 else torch.cat(summed)
        if self._replica is not None and segment.numel():
            dist.all_reduce(segment, group=self._replica)
        return segment


class _Route:
    """Where each piece of a unit sits: in the full buffer (layout order) and in the
    segment-ordered send buffer of the reduction (rank 0's segment, rank 1's, ...)."""

    def __init__(self, layout: UnitLayout, world: int):
        self.sizes = [layout.segment_numel(r) for r in range(world)]
        starts = [sum(self.sizes[:r]) for r in range(world)]
        # (parameter name, its elements (LocalPiece.runs), numel, full-buffer offset, send-buffer offset)
        self.copies = [
            (
                p.slot.param_name,
                p.runs(),
                p.numel,
                p.slot.offset + p.param_offset - p.slot.param_start,
                starts[r] + p.segment_offset,
            )
            for r in range(world)
            for p in layout.local_pieces(r)
        ]
        self.covers_all = sum(c[2] for c in self.copies) == layout.numel  # no element left to zero


class SegmentComm:
    """Owner-segment collectives of one shard group (and its replica group).

    ``traffic`` counts, per phase, the bytes this rank received from other ranks
    (gathers) or sent to them (reductions), the numbers compared with ZeRO-3's."""

    def __init__(self, groups: ProcessGroups, verify: bool = True, device=None, coalesce: bool = True):
        self.group, self.replica = groups.dp_shard, groups.replica
        self.rank, self.world = groups.dp_shard_rank, groups.dp_shard_size
        self.verify = verify and self.world > 1
        self.device = device
        self.coalesce = coalesce
        self.p2p = self.world > 1 and dist.get_backend(self.group) == "nccl"
        self.traffic = dict.fromkeys(PHASES, 0)
        self._routes: dict[int, _Route] = {}

    def route(self, layout: UnitLayout) -> _Route:
        if layout.index not in self._routes:
            self._routes[layout.index] = _Route(layout, self.world)
        return self._routes[layout.index]

    # ----------------------------------------------------------------- gather
    def start_gather(self, layout: UnitLayout, segment: torch.Tensor, phase: str = "other") -> PendingGather:
        """Start filling the unit's whole flat buffer from every owner's segment."""
        check = self._signature(layout, GATHER)
        full = torch.empty(layout.numel, dtype=segment.dtype, device=segment.device)
        parts = [
            [full[a:b] for a, b in (layout.matrix_range(r), layout.tail_range(r))] for r in range(self.world)
        ]  # each owner's segment lands in two places: its matrix part and its tail slice
        m = parts[self.rank][0].numel()
        mine = [segment[:m], segment[m:]]
        sent = as_bytes(segment) if segment.is_contiguous() else None
        self.traffic[phase] += (layout.numel - segment.numel()) * segment.element_size()
        if self.world == 1:
            return PendingGather(full, [], lambda: _copy_views(parts[0], mine))
        if not self.coalesce:
            return PendingGather(full, self._broadcasts(parts, mine), check=check)
        return self.start_gather_views(mine, parts, full, check, sent)

    def _signature(self, layout: UnitLayout, op: int):
        """The unit's signature all-gather, started before its collective (None without checks)."""
        return start_signature(self.group, layout.index, op, layout.numel, self.device) if self.verify else None

    def start_gather_views(
        self, mine: list[torch.Tensor], parts: list[list[torch.Tensor]], result=None, check=None, sent=None
    ):
        """Every rank's ``mine`` (flat tensors of any dtype) lands in ``parts[rank]`` on every rank, as
        bytes, in one collective (one NCCL group): the dtype-agnostic core of the gather. ``parts[r]``
        are this rank's destination views for rank r's pieces (``parts[self.rank]`` matches ``mine``);
        ``sent``, if given, is ``mine``'s bytes already in one tensor (the segment: no copy to make)."""
        _copy_views(parts[self.rank], mine)
        if self.p2p:
            return PendingGather(result, self._p2p_gather(mine, parts), check=check)
        if sent is None:
            sent = torch.cat([as_bytes(t) for t in mine]) if mine else torch.empty(0, dtype=torch.uint8)
        recv_sizes = [0 if r == self.rank else sum(as_bytes(v).numel() for v in parts[r]) for r in range(self.world)]
        send_sizes = [0 if r == self.rank else sent.numel() for r in range(self.world)]
        staging = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=sent.device)
        work = dist.all_to_all_single(
            staging,
            sent if self.world == 2 else sent.repeat(self.world - 1),  # one copy per receiver
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=self.group,
            async_op=True,
        )

        def unpack():
            offset = 0
            for r in range(self.world):
                for view in parts[r] if r != self.rank else ():
                    n = as_bytes(view).numel()
                    as_bytes(view).copy_(staging[offset : offset + n])
                    offset += n

        return PendingGather(result, [work], unpack, check)

    def _p2p_gather(self, mine, parts) -> list:
        ops = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            ops += [dist.P2POp(c10d.isend, as_bytes(t), group=self.group, group_peer=peer) for t in mine if t.numel()]
            ops += [
                dist.P2POp(c10d.irecv, as_bytes(v), group=self.group, group_peer=peer) for v in parts[peer] if v.numel()
            ]
        return dist.batch_isend_irecv(ops) if ops else []

    def _broadcasts(self, parts, mine) -> list:
        _copy_views(parts[self.rank], mine)
        return [
            dist.broadcast(view, group=self.group, group_src=owner, async_op=True)
            for owner in range(self.world)
            for view in parts[owner]
            if view.numel()
        ]

    # ----------------------------------------------------------------- reduce
    def pack_grads(self, layout: UnitLayout, grads: dict, dtype, scale: float) -> torch.Tensor:
        """This rank's contribution to the unit's gradient, scaled, in wire order (segment order when
        coalesced, layout order otherwise); a parameter without a gradient contributes zeros. The
        scale is applied as each gradient is copied when dtypes match (one pass instead of copy,
        then scale; the same products), and only uncovered elements are zeroed."""
        route = self.route(layout)
        complete = route.covers_all and all(grads.get(name) is not None for name, *_ in route.copies)
        out = (torch.empty if complete else torch.zeros)(layout.numel, dtype=dtype, device=self.device)
        for name, runs, numel, full_offset, send_offset in route.copies:
            grad = grads.get(name)
            if grad is None:
                continue
            at = send_offset if self.coalesce else full_offset
            src, dst = param_runs_view(grad.reshape(-1), runs), out[at : at + numel].view(runs[3], runs[1])
            if scale == 1.0:
                dst.copy_(src)
            elif src.dtype == dtype:
                torch.mul(src, scale, out=dst)
            else:
                dst.copy_(src).mul_(scale)
        return out

    def start_reduce(self, layout: UnitLayout, packed: torch.Tensor) -> PendingReduce:
        """Start summing ``packed`` (this rank's contribution from ``pack_grads``) over the group;
        ``wait()`` returns this rank's segment of the sum, added in rank order. Always started
        asynchronously, so its signature check is verified in ``wait()`` without a second sync."""
        check = self._signature(layout, REDUCE)
        mine = layout.segment_numel(self.rank)
        self.traffic["reduce"] += (layout.numel - mine) * packed.element_size()
        if self.world == 1:
            return PendingReduce([packed.view(1, mine)], self.replica)
        if not self.coalesce:
            return self._reduce_per_region(layout, packed, check)
        received = torch.empty(self.world * mine, dtype=packed.dtype, device=packed.device)
        work = dist.all_to_all_single(
            received,
            packed,
            output_split_sizes=[mine] * self.world,
            input_split_sizes=self.route(layout).sizes,
            group=self.group,
            async_op=True,
        )
        return PendingReduce([received.view(self.world, mine)], self.replica, [work], packed, check)

    def _reduce_per_region(self, layout: UnitLayout, packed: torch.Tensor, check) -> PendingReduce:
        regions, works = [], []
        for region, bounds, (lo, hi) in (
            (packed[: layout.matrix_numel], layout.matrix_bounds, layout.matrix_range(self.rank)),
            (packed[layout.matrix_numel :], layout.tail_bounds, layout.tail_range(self.rank)),
        ):
            mine = hi - lo
            received = torch.empty(self.world * mine, dtype=packed.dtype, device=packed.device)
            work = dist.all_to_all_single(
                received,
                region,
                output_split_sizes=[mine] * self.world,
                input_split_sizes=[bounds[r + 1] - bounds[r] for r in range(self.world)],
                group=self.group,
                async_op=True,
            )
            works.append(work)
            regions.append(received.view(self.world, mine))
        return PendingReduce(regions, self.replica, works, packed, check)


def _copy_views(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        if d.numel():
            d.copy_(s)


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
