"""Owner assignment: which data-parallel rank holds each whole matrix.

Largest first: each matrix goes to the rank whose normalized load (cost share +
element share) after taking it is smallest; ties go to the lower rank. Every rank
starts with an even share of the tail's elements. 'greedy' walks the units in order
and carries each rank's load across them, so consecutive units spread their owners;
'global' sorts all matrices at once, which balances better when matrix sizes differ
a lot across units; 'auto' keeps whichever has the smaller worst max/mean of bytes
and cost.
"""

from __future__ import annotations

from collections.abc import Sequence

from .layout import ParamSpec, Plan, UnitSpec, balance, layout_units
from .rules import WHOLE

POLICIES = ("greedy", "global", "auto")


def _assign_owners(
    matrices: list[ParamSpec],
    world_size: int,
    cost_load: list[float],
    bytes_load: list[float],
    total_cost: float,
    total_bytes: float,
) -> dict[str, int]:
    owners = {}
    order = sorted(matrices, key=lambda p: (-p.cost, -p.numel, p.name))
    for p in order:

        def score(r, p=p):
            return (cost_load[r] + p.cost) / max(total_cost, 1) + (bytes_load[r] + p.numel) / max(total_bytes, 1)

        r = min(range(world_size), key=lambda r: (score(r), r))
        owners[p.name] = r
        cost_load[r] += p.cost
        bytes_load[r] += p.numel
    return owners


def plan_units(units: Sequence[UnitSpec], world_size: int, policy: str = "auto") -> Plan:
    """Assign every WHOLE parameter an owner among ``world_size`` DP ranks and lay out each unit."""
    if world_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {world_size}")
    names = [p.name for u in units for p in u.params]
    if len(set(names)) != len(names):
        raise ValueError("a parameter appears in two units")
    if policy == "auto":
        candidates = [plan_units(units, world_size, p) for p in ("greedy", "global")]
        return min(candidates, key=lambda plan: max(balance(v) for v in plan.per_rank_load()))
    if policy not in POLICIES:
        raise ValueError(f"unknown planner policy {policy!r} (--mfsdp-planner); choose one of {', '.join(POLICIES)}")
    all_params = [p for u in units for p in u.params]
    matrices = [p for p in all_params if p.storage == WHOLE]
    tail_total = sum(p.numel for p in all_params if p.storage != WHOLE)
    totals = (sum(p.cost for p in matrices), sum(p.numel for p in all_params))
    cost_load = [0.0] * world_size
    bytes_load = [tail_total / world_size] * world_size
    owners: dict[str, int] = {}
    groups = [[p for p in u.params if p.storage == WHOLE] for u in units] if policy == "greedy" else [matrices]
    for group in groups:
        owners.update(_assign_owners(group, world_size, cost_load, bytes_load, *totals))
    return layout_units(units, world_size, owners, policy)
