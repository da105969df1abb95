"""Owner-segment communication behind one small interface: ``start_gather`` and
``start_reduce`` return a pending operation whose ``wait()`` gives the result. This is
the one place where the wire format, coalescing and overlap are decided.

Segments are uneven and may be empty, so nothing here pads a rank up to the largest
segment: weights travel by one broadcast per non-empty owner part (exactly the unit's
bytes), gradients by ``all_to_all_single`` with per-rank split sizes (zero allowed).
The owner sums the W contributions itself, in rank order, so the result does not
depend on the backend's reduction tree: the same sum a single process computes. With
hybrid sharding the reduced segment is then all-reduced over the replica group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..groups import ProcessGroups
from ..placement.layout import UnitLayout
from ..placement.verify import GATHER, REDUCE, check_signature


class PendingGather:
    """A unit's full buffer being filled from every owner's segment."""

    def __init__(self, full: torch.Tensor, works: list):
        self.full, self._works = full, works

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works = []
        return self.full


class PendingReduce:
    """The contributions of every rank to this rank's segment, summed on ``wait()``."""

    def __init__(self, contributions: list[torch.Tensor], replica_group):
        self._contributions, self._replica = contributions, replica_group

    def wait(self) -> torch.Tensor:
        summed = []
        for region in self._contributions:  # [world, numel] per region (matrix, tail)
            total = region[0].float()  # the owner sums in fp32 even when the wire carries bf16
            total = total.clone() if total.data_ptr() == region[0].data_ptr() else total
            for r in range(1, region.shape[0]):
                total.add_(region[r])
            summed.append(total)
        segment = torch.cat(summed)
        if self._replica is not None and segment.numel():
            dist.all_reduce(segment, group=self._replica)
        return segment


class SegmentComm:
    """Owner-segment collectives of one shard group (and its replica group)."""

    def __init__(self, groups: ProcessGroups, verify: bool = True, device=None):
        self.group, self.replica = groups.dp_shard, groups.replica
        self.rank, self.world = groups.dp_shard_rank, groups.dp_shard_size
        self.verify = verify and self.world > 1
        self.device = device

    def start_gather(self, layout: UnitLayout, segment: torch.Tensor) -> PendingGather:
        """Start filling the unit's whole flat buffer from every owner's segment."""
        if self.verify:
            check_signature(self.group, layout.index, GATHER, layout.numel, self.device)
        full = torch.empty(layout.numel, dtype=segment.dtype, device=segment.device)
        (m0, m1), (t0, t1) = layout.matrix_range(self.rank), layout.tail_range(self.rank)
        full[m0:m1].copy_(segment[: m1 - m0])
        full[t0:t1].copy_(segment[m1 - m0 :])
        works = []
        if self.world > 1:
            for owner in range(self.world):
                for start, end in (layout.matrix_range(owner), layout.tail_range(owner)):
                    if end > start:
                        works.append(dist.broadcast(full[start:end], group=self.group, group_src=owner, async_op=True))
        return PendingGather(full, works)

    def start_reduce(self, layout: UnitLayout, full_grad: torch.Tensor) -> PendingReduce:
        """Start summing ``full_grad`` (this rank's contribution to the whole unit) over the
        group; ``wait()`` returns this rank's segment of the sum, added in rank order."""
        if self.verify:
            check_signature(self.group, layout.index, REDUCE, layout.numel, self.device)
        regions = []
        for region, bounds, (lo, hi) in (
            (full_grad[: layout.matrix_numel], layout.matrix_bounds, layout.matrix_range(self.rank)),
            (full_grad[layout.matrix_numel :], layout.tail_bounds, layout.tail_range(self.rank)),
        ):
            mine = hi - lo
            if self.world == 1:
                regions.append(full_grad[lo:hi].view(1, mine))
                continue
            received = torch.empty(self.world * mine, dtype=full_grad.dtype, device=full_grad.device)
            dist.all_to_all_single(
                received,
                region,
                output_split_sizes=[mine] * self.world,
                input_split_sizes=[bounds[r + 1] - bounds[r] for r in range(self.world)],
                group=self.group,
            )
            regions.append(received.view(self.world, mine))
        return PendingReduce(regions, self.replica)


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
