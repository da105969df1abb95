"""Owner-segment collectives: gather a unit's weights from their owners, and
deliver each owner the reduced gradient of its segment.

Segments are uneven and may be empty, so nothing here pads a rank up to the
largest segment: weights travel by one broadcast per non-empty owner part
(exactly the unit's bytes), gradients by ``all_to_all_single`` with per-rank
split sizes (zero allowed). The owner sums the W contributions itself, in rank
order, so the result does not depend on the backend's reduction tree: the same
sum a single process computes.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .placement import UnitLayout

GATHER, REDUCE = 1, 2
_OP_NAMES = {GATHER: "gather", REDUCE: "reduce"}


def check_signature(group, unit_index: int, op: int, numel: int, device=None) -> None:
    """All-gather (unit, op, numel) and raise on any mismatch, so that ranks that
    diverged fail loudly here instead of hanging in (or corrupting) the real collective."""
    world = dist.get_world_size(group)
    mine = torch.tensor([unit_index, op, numel], dtype=torch.int64, device=device)
    everyone = torch.empty(world * 3, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(world, 3).tolist()
    if any(row != rows[0] for row in rows):
        described = ", ".join(f"rank {r}: {_OP_NAMES.get(op, op)} unit {u} ({n} elements)"
                              for r, (u, op, n) in enumerate(rows))
        raise RuntimeError(f"MatrixFSDP collective mismatch across the data-parallel group: {described}")


def gather_unit_async(layout: UnitLayout, segment: torch.Tensor, full: torch.Tensor,
                      group, rank: int) -> List[dist.Work]:
    """Start filling ``full`` (the unit's whole flat buffer) from every owner's
    segment. Returns the pending works; the caller waits on them before use."""
    works = []
    world = layout.world_size
    (m0, m1) = layout.matrix_range(rank)
    t0, t1 = layout.tail_range(rank)
    full[m0:m1].copy_(segment[: m1 - m0])
    full[t0:t1].copy_(segment[m1 - m0:])
    if world == 1:
        return works
    for owner in range(world):
        for start, end in (layout.matrix_range(owner), layout.tail_range(owner)):
            if end > start:
                works.append(dist.broadcast(full[start:end], group=group, group_src=owner, async_op=True))
    return works


def reduce_unit(layout: UnitLayout, full_grad: torch.Tensor, group, rank: int) -> torch.Tensor:
    """Sum ``full_grad`` (this rank's contribution to the whole unit) over the
    group and return this rank's segment of the sum, added in rank order."""
    world = layout.world_size
    m0, m1 = layout.matrix_range(rank)
    t0, t1 = layout.tail_range(rank)
    if world == 1:
        return torch.cat([full_grad[m0:m1], full_grad[t0:t1]])
    summed = []
    for region, bounds, (lo, hi) in (
        (full_grad[: layout.matrix_numel], layout.matrix_bounds, (m0, m1)),
        (full_grad[layout.matrix_numel:], layout.tail_bounds, (t0, t1)),
    ):
        send_sizes = [bounds[r + 1] - bounds[r] for r in range(world)]
        mine = hi - lo
        received = torch.empty(world * mine, dtype=full_grad.dtype, device=full_grad.device)
        dist.all_to_all_single(received, region, output_split_sizes=[mine] * world,
                               input_split_sizes=send_sizes, group=group)
        contributions = received.view(world, mine)
        total = contributions[0].clone()
        for r in range(1, world):
            total.add_(contributions[r])
        summed.append(total)
    return torch.cat(summed)
