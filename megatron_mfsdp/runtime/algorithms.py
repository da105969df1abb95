"""The owner collectives besides per-part calls over the whole shard group (runtime/comm.py's
``parts``): ``two_level`` (a node's fast links, then the rails across nodes) and ``padded`` (one call,
more bytes). SegmentComm inherits them; they use its buffers, charges and call grouping.

``two_level`` (node levels: node_levels.py; N nodes of m shard ranks, rank g on node g // m at local
index g % m). It saves ring latency, not bytes: a ring over N rails then one over m node ranks instead
of one over W ranks.

- gather of an owner part: a broadcast over the owner's rail rooted at the owner (inter-node: one copy
  of the part enters each node), then a broadcast inside every node rooted at its rank on that rail.
- gather of the tail (W slices, padded): an all-gather over this rank's rail of the slices at its local
  index, then an all-gather inside the node of those N-slice blocks, permuted into rank order. Rail
  first is the bandwidth-optimal order: each node takes in its (N - 1) m slices from outside exactly
  once, (N - 1) slices per rank; node first would bring every remote slice in on all m rails.
- reduce: the mirror. Per part a reduce inside each node into its rank on the owner's rail, then a
  reduce over that rail into the owner; the tail a reduce-scatter inside the node (of the blocks in
  local-index order), then one over the rail. Sum order: each node's sum in the backend's order, then
  the node sums across nodes in the backend's order; not the single-process rank order, so it is held
  to the reference with a rounding bound, never bitwise.

A rank on a level's root must hold the data before the second level starts, so the first level's works
are waited for in between (on NCCL a wait orders streams and does not block the host; on gloo it
blocks, so the unit's signature check is verified first, once the first level is issued: ranks that
disagree raise instead of hanging there).

``padded``: one all-gather of every rank's segment padded to the largest, or one reduce-scatter of the
gradient packed as W such padded segments; summed in the backend's reduce-scatter order. Every rank
moves (W - 1) x the largest segment: a unit whose matrices sit on one owner costs W x its share.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat.collectives import all_gather_single, reduce_scatter_single
from ..placement.layout import UnitLayout
from .traffic import FLAT, INTER, INTRA, add, broadcast_link, owner_parts, reduce_link, slices_link


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor of any dtype (what the gather moves)."""
    return t.reshape(-1).view(torch.uint8)


class LevelledCollectives:
    """``two_level`` and ``padded`` for SegmentComm (which provides ``levels``, ``rank``, ``world``,
    ``_buffer``, ``_charge`` and ``_grouped``)."""

    # ----------------------------------------------------------- two levels
    def two_level_gather(self, layout: UnitLayout, full: torch.Tensor, tail, phase: str, check=None) -> list:
        """Start the two-level gather into ``full`` (this rank's segment already in place; ``tail``:
        (output, this rank's slice, finish) of the tail's all-gather, or None); returns the works of
        the last level. Charged per level."""
        lv, elsize, device = self.levels, full.element_size(), full.device
        node, local = lv.where(self.rank)
        parts = owner_parts(layout)
        rail_parts = [(lv.where(o)[0], lo, hi) for o, lo, hi in parts if lv.where(o)[1] == local]
        inter, intra = (0, 0), (0, 0)

        def rail_bcast(root, lo, hi):
            return dist.broadcast(as_bytes(full[lo:hi]), group=lv.rail, group_src=root, async_op=True)

        def node_bcast(root, lo, hi):
            return dist.broadcast(as_bytes(full[lo:hi]), group=lv.node, group_src=root, async_op=True)

        first = []
        if lv.rail is not None:
            first = self._grouped(lv.rail, rail_bcast, rail_parts, device)
            for root, lo, hi in rail_parts:
                inter = add(inter, broadcast_link((hi - lo) * elsize, node, root, lv.nodes))
        _verify(check)
        block = None
        if tail is not None:
            block, rail_link = self._rail_gather_tail(tail[1])
            inter = add(inter, rail_link)
        _wait(first)
        works = []
        if lv.node is not None:
            node_parts = [(lv.where(o)[1], lo, hi) for o, lo, hi in parts]
            works = self._grouped(lv.node, node_bcast, node_parts, device)
            for root, lo, hi in node_parts:
                intra = add(intra, broadcast_link((hi - lo) * elsize, local, root, lv.per_node))
        if tail is not None:
            work, node_link = self._node_gather_tail(tail[0], block)
            works += work
            intra = add(intra, node_link)
        self._charge_levels(phase, layout.index, "gather", inter, intra)
        return works

    def _rail_gather_tail(self, mine: torch.Tensor):
        """The tail's first level: this rank's slice from every node of its rail, waited for."""
        lv, elsize = self.levels, mine.element_size()
        if lv.rail is None:
            return mine, (0, 0)
        block = self._buffer(lv.nodes * mine.numel(), mine.dtype, mine.device)
        all_gather_single(as_bytes(block), as_bytes(mine), group=lv.rail, async_op=True).wait()
        return block, slices_link(mine.numel() * elsize, lv.nodes)

    def _node_gather_tail(self, out: torch.Tensor, block: torch.Tensor):
        """The tail's second level: every local index's rail block, into ``out`` in rank order (a
        permutation of local-index order, done on ``wait()``)."""
        lv, elsize = self.levels, block.element_size()
        if lv.node is None:
            out.copy_(block)
            return [], (0, 0)
        local_major = self._buffer(out.numel(), out.dtype, out.device)
        work = all_gather_single(as_bytes(local_major), as_bytes(block), group=lv.node, async_op=True)

        def into_rank_order():
            out.view(lv.nodes, lv.per_node, -1).copy_(local_major.view(lv.per_node, lv.nodes, -1).transpose(0, 1))

        return [Then(work, into_rank_order)], slices_link(block.numel() * elsize, lv.per_node)

    def two_level_reduce(self, layout: UnitLayout, packed: torch.Tensor, out_tail, check=None) -> list:
        """Start the two-level reduction of ``packed`` (in place: each owner's part ends summed on it;
        ``out_tail``: this rank's tail slice, or None); returns the works of the last level."""
        lv, elsize, device = self.levels, packed.element_size(), packed.device
        node, local = lv.where(self.rank)
        parts, inter, intra = owner_parts(layout), (0, 0), (0, 0)

        def node_reduce(root, lo, hi):
            return dist.reduce(packed[lo:hi], group=lv.node, group_dst=root, async_op=True)

        def rail_reduce(root, lo, hi):
            return dist.reduce(packed[lo:hi], group=lv.rail, group_dst=root, async_op=True)

        first = []
        if lv.node is not None:
            node_parts = [(lv.where(o)[1], lo, hi) for o, lo, hi in parts]
            first = self._grouped(lv.node, node_reduce, node_parts, device)
            for root, lo, hi in node_parts:
                intra = add(intra, reduce_link((hi - lo) * elsize, local, root, lv.per_node))
        _verify(check)
        block = None
        if out_tail is not None:
            block, node_link = self._node_reduce_tail(packed[layout.matrix_numel :], out_tail)
            intra = add(intra, node_link)
        _wait(first)
        works = []
        if lv.rail is not None:
            rail_parts = [(lv.where(o)[0], lo, hi) for o, lo, hi in parts if lv.where(o)[1] == local]
            works = self._grouped(lv.rail, rail_reduce, rail_parts, device)
            for root, lo, hi in rail_parts:
                inter = add(inter, reduce_link((hi - lo) * elsize, node, root, lv.nodes))
        if out_tail is not None:
            if lv.rail is None:
                out_tail.copy_(block)
            else:
                works.append(reduce_scatter_single(out_tail, block, group=lv.rail, async_op=True))
                inter = add(inter, slices_link(out_tail.numel() * elsize, lv.nodes))
        self._charge_levels(phase="reduce", unit=layout.index, op="reduce", inter=inter, intra=intra)
        return works

    def _node_reduce_tail(self, tail: torch.Tensor, out_tail: torch.Tensor):
        """The tail's first level: the padded slices in local-index order, reduce-scattered inside the node
        (waited for): this rank gets its node's sum of the N slices at its local index."""
        lv, s = self.levels, out_tail.numel()
        if lv.node is None:
            return tail, (0, 0)
        local_major = self._buffer(tail.numel(), tail.dtype, tail.device)
        local_major.view(lv.per_node, lv.nodes, s).copy_(tail.view(lv.nodes, lv.per_node, s).transpose(0, 1))
        block = self._buffer(lv.nodes * s, tail.dtype, tail.device)
        reduce_scatter_single(block, local_major, group=lv.node, async_op=True).wait()
        return block, slices_link(block.numel() * tail.element_size(), lv.per_node)

    def _charge_levels(self, phase: str, unit: int, op: str, inter, intra) -> None:
        """One record per level this rank's calls used (the rail's first, as they run)."""
        for level, link, group in ((INTER, inter, self.levels.rail), (INTRA, intra, self.levels.node)):
            if group is not None:
                self._charge(phase, unit, op, link, level)

    # --------------------------------------------------------------- padded
    def padded_gather(self, layout: UnitLayout, full: torch.Tensor, segment: torch.Tensor, phase: str):
        """One all-gather of every rank's segment padded to the largest; (works, finish)."""
        size = max(layout.segment_numel(r) for r in range(self.world))
        mine = torch.zeros(size, dtype=segment.dtype, device=segment.device)
        mine[: segment.numel()].copy_(segment)
        out = self._buffer(self.world * size, segment.dtype, segment.device)
        work = all_gather_single(as_bytes(out), as_bytes(mine), group=self.group, async_op=True)
        self._charge(phase, layout.index, "gather", slices_link(size * segment.element_size(), self.world), FLAT)

        def finish():
            for r in range(self.world):
                (m0, m1), (t0, t1) = layout.matrix_range(r), layout.tail_range(r)
                at = r * size
                full[m0:m1].copy_(out[at : at + m1 - m0])
                full[t0:t1].copy_(out[at + m1 - m0 : at + m1 - m0 + t1 - t0])

        return [work], finish

    def padded_reduce(self, layout: UnitLayout, packed: torch.Tensor, slice_numel: int):
        """One reduce-scatter of ``packed`` rearranged as W segments padded to the largest; (works, out):
        this rank's segment is ``out``'s first ``segment_numel`` elements once the works are done."""
        size = max(layout.segment_numel(r) for r in range(self.world))
        padded = self._buffer(self.world * size, packed.dtype, packed.device).zero_()
        for r in range(self.world):
            (m0, m1), (t0, t1) = layout.matrix_range(r), layout.tail_range(r)
            tail_at = layout.matrix_numel + r * slice_numel
            padded[r * size : r * size + m1 - m0].copy_(packed[m0:m1])
            padded[r * size + m1 - m0 : r * size + m1 - m0 + t1 - t0].copy_(packed[tail_at : tail_at + t1 - t0])
        out = self._buffer(size, packed.dtype, packed.device)
        work = reduce_scatter_single(out, padded, group=self.group, async_op=True)
        self._charge("reduce", layout.index, "reduce", slices_link(size * packed.element_size(), self.world), FLAT)
        return [work], out


class Then:
    """A work whose ``wait()`` also runs a step that needs its result (a permutation into place)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        self.work.wait()
        if self.then is not None:
            self.then()
            self.then = None


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _verify(check) -> None:
    """The unit's signature check (None: checks off), before this rank blocks on a first level."""
    if check is not None:
        check.verify()
