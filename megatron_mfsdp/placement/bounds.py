"""Lower bounds on the planner's max/mean: no owner assignment of the same matrices to
the same number of ranks can do better, so a plan at its bound is optimal.

For whole items of sizes a_1 >= a_2 >= ... over W ranks the largest load is at least
  * the largest item a_1 (it goes somewhere whole),
  * the mean, total / W (rounded up: loads are integers),
  * a_W + a_(W+1) (pigeonhole: two of the W+1 largest items share a rank), and in
    general, for every k >= 1, the k+1 smallest of the kW+1 largest items
    a_(kW-k+1) + ... + a_(kW+1) (some rank holds k+1 of them).
NS flops are the items' costs. Bytes are the matrices' elements plus each rank's slice
of the tail, which is no less than the sum over units of floor(tail elements / W).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .classes import WHOLE
from .layout import UnitSpec


def max_load_bound(sizes: Sequence[int], world_size: int) -> int:
    """The largest of the bounds above on the largest load of ``world_size`` ranks."""
    a = sorted(sizes, reverse=True)
    bound = max(a[0] if a else 0, -(-sum(a) // world_size))
    k = 1
    while k * world_size < len(a):
        bound = max(bound, sum(a[k * world_size - k : k * world_size + 1]))
        k += 1
    return bound


@dataclass(frozen=True)
class PlanBounds:
    """Lower bounds on max/mean over ranks (1.0 is perfect balance)."""

    bytes: float
    ns_flops: float

    @property
    def joint(self) -> float:
        """Bound on the planner's score, the larger of the two shares."""
        return max(self.bytes, self.ns_flops)


def plan_bounds(units: Sequence[UnitSpec], world_size: int) -> PlanBounds:
    """Lower bounds on the bytes and NS-flops max/mean of any plan of ``units``."""
    params = [p for u in units for p in u.params]
    matrices = [p for p in params if p.storage == WHOLE]
    total_cost = sum(p.cost for p in matrices)
    total_elements = sum(p.weight if p.storage == WHOLE else p.numel for p in params)
    ns = max_load_bound([p.cost for p in matrices], world_size) * world_size / total_cost if total_cost else 1.0
    least_tail = sum(sum(p.numel for p in u.params if p.storage != WHOLE) // world_size for u in units)
    elements = max(
        -(-total_elements // world_size), max_load_bound([p.weight for p in matrices], world_size) + least_tail
    )
    nbytes = elements * world_size / total_elements if total_elements else 1.0
    return PlanBounds(bytes=nbytes, ns_flops=ns)
