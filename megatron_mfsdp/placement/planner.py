"""Owner assignment: which data-parallel rank holds each whole matrix.

Two constructions, largest first: each matrix goes to the rank whose normalized load
(cost share + element share) after taking it is smallest; ties go to the lower rank.
Every rank starts with an even share of the tail's elements.

  greedy  walks the units in order and carries each rank's load across them, so
          consecutive units spread their owners. Constructive only.
  global  sorts all matrices at once, which balances better when matrix sizes differ a
          lot across units. Constructive only.
  auto    (the default) builds both, improves each by the local search of search.py
          (moves, swaps and exchanges of matrices between two or three ranks, scored
          by each rank's larger share of NS cost and of bytes), and keeps the best plan
          by its per-rank shares sorted worst first: the max, then the second max, ...
          The constructions themselves stay candidates, so 'auto' is never worse than
          either. Deterministic: same inputs, same plan on every rank.

'greedy' and 'global' are kept as they were (without search) to reproduce older plans.

A plan over a group whose ranks already hold loads in another shard domain (the experts over expert
DP, after the dense plan) starts each rank from its load there (``base``): the global construction
then balances each rank's total (joint_owners).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .classes import WHOLE
from .layout import ParamSpec, Plan, UnitSpec, layout_units
from .search import OwnerSearch

POLICIES = ("greedy", "global", "auto")


@dataclass(frozen=True)
class RankLoads:
    """Per rank of a plan's group, what it holds elsewhere: planner cost (Newton-Schulz multiply-adds)
    and weight (elements plus extra state, ParamSpec.weight), as Plan.cost_per_rank and
    Plan.per_rank_weight count them."""

    cost: tuple[int, ...]
    weight: tuple[int, ...]


def _assign_owners(
    matrices: list[ParamSpec],
    world_size: int,
    cost_load: list[float],
    bytes_load: list[float],
    total_cost: float,
    total_bytes: float,
) -> dict[str, int]:
    owners = {}
    order = sorted(matrices, key=lambda p: (-p.cost, -p.weight, p.name))
    per_cost, per_byte = max(total_cost, 1), max(total_bytes, 1)
    for p in order:
        cost, weight = p.cost, p.weight  # read once: the score below runs W times per matrix
        # min keeps the first (lowest) rank of equal scores
        r = min(range(world_size), key=lambda r: (cost_load[r] + cost) / per_cost + (bytes_load[r] + weight) / per_byte)
        owners[p.name] = r
        cost_load[r] += cost
        bytes_load[r] += weight
    return owners


def constructive_owners(units: Sequence[UnitSpec], world_size: int, policy: str) -> dict[str, int]:
    """The owner of every WHOLE parameter by the 'greedy' or 'global' construction."""
    all_params = [p for u in units for p in u.params]
    matrices = [p for p in all_params if p.storage == WHOLE]
    tail_total = sum(p.numel for p in all_params if p.storage != WHOLE)
    totals = (sum(p.cost for p in matrices), sum(p.weight for p in matrices) + tail_total)
    cost_load = [0.0] * world_size
    bytes_load = [tail_total / world_size] * world_size
    owners: dict[str, int] = {}
    groups = [[p for p in u.params if p.storage == WHOLE] for u in units] if policy == "greedy" else [matrices]
    for group in groups:
        owners.update(_assign_owners(group, world_size, cost_load, bytes_load, *totals))
    return owners


def searched_owners(units: Sequence[UnitSpec], world_size: int, owners: dict[str, int]) -> tuple[dict[str, int], bool]:
    """``owners`` improved by the local search (search.py), never worse by its score;
    and whether the result meets the lower bounds of both cost and elements."""
    matrices = [p for u in units for p in u.params if p.storage == WHOLE]
    tail = sum(p.numel for u in units for p in u.params if p.storage != WHOLE)
    search = OwnerSearch(matrices, world_size, tail, owners)
    search.improve()
    return search.owners(), search.at_bounds()


def plan_key(plan: Plan) -> tuple[int, ...]:
    """A plan's per-rank shares, max(cost / mean cost, weight / mean weight), sorted worst first and
    scaled to integers: smaller (lexicographically) is better. A rank's weight is its elements plus its
    matrices' extra state (``ParamSpec.weight``)."""
    elements, costs = plan.per_rank_weight(), plan.cost_per_rank
    total_elements, total_cost = sum(elements), sum(costs)
    if total_cost == 0:
        return tuple(sorted(elements, reverse=True))
    return tuple(sorted((max(c * total_elements, e * total_cost) for e, c in zip(elements, costs)), reverse=True))


def _auto(units: Sequence[UnitSpec], world_size: int) -> Plan:
    """Each construction and its searched improvement; the best by plan_key (the
    earlier candidate on ties: searched plans first). A searched 'global' plan at the
    lower bounds ends it there."""
    candidates = []
    for policy in ("global", "greedy"):
        start = constructive_owners(units, world_size, policy)
        owners, optimal = searched_owners(units, world_size, start)
        candidates.append(layout_units(units, world_size, owners, f"{policy}+search"))
        candidates.append(layout_units(units, world_size, start, policy))
        if optimal:
            break
    keys = [plan_key(plan) for plan in candidates]
    return candidates[min(range(len(candidates)), key=lambda i: (keys[i], i))]


def joint_owners(units: Sequence[UnitSpec], world_size: int, base: RankLoads) -> dict[str, int]:
    """The owner of every WHOLE parameter by the global construction, each rank starting from ``base``:
    what it already holds in another shard domain (a rank is in both), so each rank's total is balanced."""
    all_params = [p for u in units for p in u.params]
    matrices = [p for p in all_params if p.storage == WHOLE]
    tail_total = sum(p.numel for p in all_params if p.storage != WHOLE)
    cost_load = [float(c) for c in base.cost]
    bytes_load = [w + tail_total / world_size for w in base.weight]
    totals = (sum(cost_load) + sum(p.cost for p in matrices), sum(bytes_load) + sum(p.weight for p in matrices))
    return _assign_owners(matrices, world_size, cost_load, bytes_load, *totals)


def plan_units(units: Sequence[UnitSpec], world_size: int, policy: str = "auto", base: RankLoads | None = None) -> Plan:
    """Assign every WHOLE parameter an owner among ``world_size`` DP ranks and lay out each unit.
    With ``base`` (each rank's load in another shard domain: the experts' plan over expert DP is made
    after the dense one) every policy is the global construction from those loads, unsearched: the
    search's moves assume ranks that differ only by what they own here."""
    if world_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {world_size}")
    names = [p.name for u in units for p in u.params]
    if len(set(names)) != len(names):
        raise ValueError("a parameter appears in two units")
    if policy not in POLICIES:
        raise ValueError(f"unknown planner policy {policy!r} (--mfsdp-planner); choose one of {', '.join(POLICIES)}")
    if base is not None:
        if len(base.cost) != world_size or len(base.weight) != world_size:
            raise ValueError(f"base loads of {len(base.cost)} ranks for a plan over {world_size}")
        return layout_units(units, world_size, joint_owners(units, world_size, base), "global+joint")
    if policy == "auto":
        return _auto(units, world_size)
    return layout_units(units, world_size, constructive_owners(units, world_size, policy), policy)
