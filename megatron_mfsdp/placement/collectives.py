"""The owner-collective algorithm of every unit of a plan, gather and reduction apart: chosen at
plan time from the layout alone by the cost model (collective_cost.py), or forced with
--mfsdp-collectives, and kept with the plan (``Plan.collectives``).

Ranks that chose differently would issue different collectives and hang, so the cross-rank
agreement check covers the choice (``Plan.agreement_digest``). The layout digest a checkpoint
compares (``Plan.digest``) does not: every algorithm moves the same elements to the same places,
so a checkpoint saved under one choice loads under another.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .collective_cost import (
    ALGORITHMS,
    CHAIN,
    MODE_ALGORITHM,
    MODES,
    PARTS,
    CostConstants,
    Topology,
    UnitShape,
    algorithm_times,
    chain_time,
    constants_for,
    fastest,
)
from .layout import Plan

REDUCE_ORDERS = ("rank", "ring")  # resolved reduce orders (runtime/comm.py resolve_reduce_order)
GRAD_REDUCE_BYTES = 4  # MatrixFSDPConfig.grad_reduce_in_fp32's default: reductions in fp32
CHAIN_SUM_BYTES = 4  # the rank-ordered chain always passes fp32 partial sums (runtime/chain.py)
FULL_TABLE_MAX_UNITS = 16  # the plan table lists every unit up to this many, else one row per choice
NAMES_PER_GROUP = 3  # units named in a row of the grouped table


@dataclass(frozen=True)
class UnitChoice:
    """One unit's algorithms and the predicted seconds of every algorithm, per direction."""

    index: int
    name: str
    gather: str
    reduce: str  # PARTS where the reduction is the rank-ordered chain
    gather_times: tuple[float, ...]  # ALGORITHMS order
    reduce_times: tuple[float, ...]
    chain_s: float | None = None  # the chain's predicted time where the reduction is the chain

    @property
    def gather_s(self) -> float:
        return self.gather_times[ALGORITHMS.index(self.gather)]

    @property
    def reduce_s(self) -> float:
        return self.chain_s if self.chain_s is not None else self.reduce_times[ALGORITHMS.index(self.reduce)]

    @property
    def reduce_label(self) -> str:
        return CHAIN if self.chain_s is not None else self.reduce


@dataclass(frozen=True)
class CollectivePlan:
    """Every unit's choice, and what it was chosen for."""

    world: int
    per_node: int
    backend: str
    mode: str
    reduce_order: str
    units: tuple[UnitChoice, ...]

    def choices(self) -> dict[int, tuple[str, str]]:
        """Unit index -> (gather algorithm, reduce algorithm); a rank-order chain reduces as PARTS."""
        return {u.index: (u.gather, u.reduce) for u in self.units}

    def digest(self) -> str:
        """A hash of the choices and what they were made for (not the predicted times)."""
        payload = [self.world, self.per_node, self.backend, self.mode, self.reduce_order]
        payload.append([(u.index, u.gather, u.reduce_label) for u in self.units])
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()

    def report(self) -> str:
        """The plan table's collective lines: per unit (or per choice, above FULL_TABLE_MAX_UNITS
        units) the algorithms and their predicted time per call, then the totals against ``parts``."""
        lines = [
            f"owner collectives ({self.mode}; W {self.world}, {self.per_node} ranks per node, {self.backend}, "
            f"reduce order {self.reduce_order}), predicted per call, us (times: {' / '.join(ALGORITHMS)})"
        ]
        if len(self.units) <= FULL_TABLE_MAX_UNITS:
            lines += [_unit_row(u) for u in self.units]
        else:
            lines += _grouped_rows(self.units)
        chosen = sum(u.gather_s for u in self.units), sum(u.reduce_s for u in self.units)
        parts = sum(u.gather_times[0] for u in self.units), sum(u.reduce_times[0] for u in self.units)
        lines.append(
            f"all units: gathers {_us(chosen[0])} us (parts {_us(parts[0])}), "
            f"reductions {_us(chosen[1])} us (parts{' in ring order' if self.reduce_order == 'rank' else ''} "
            f"{_us(parts[1])})"
        )
        return "\n".join(lines)


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:,.1f}"


def _unit_row(u: UnitChoice) -> str:
    g = " / ".join(map(_us, u.gather_times))
    r = " / ".join(map(_us, u.reduce_times))
    return (
        f"  {u.index:>4} {u.name:<16} gather {u.gather:<9} {_us(u.gather_s):>10} ({g})  "
        f"reduce {u.reduce_label:<9} {_us(u.reduce_s):>10} ({r})"
    )


def _grouped_rows(units: tuple[UnitChoice, ...]) -> list[str]:
    """One row per (gather, reduce) choice: how many units, their predicted time, a few names."""
    groups: dict[tuple[str, str], list[UnitChoice]] = {}
    for u in units:
        groups.setdefault((u.gather, u.reduce_label), []).append(u)
    rows = []
    for (gather, reduce), members in sorted(groups.items()):
        names = ", ".join(m.name for m in members[:NAMES_PER_GROUP])
        names += ", ..." if len(members) > NAMES_PER_GROUP else ""
        rows.append(
            f"  {len(members):>5} units gather {gather:<9} {_us(sum(m.gather_s for m in members)):>12} "
            f"reduce {reduce:<9} {_us(sum(m.reduce_s for m in members)):>12}  ({names})"
        )
    return rows


def choose_collectives(
    plan: Plan,
    ranks_per_node: int,
    backend: str,
    mode: str = "auto",
    reduce_order: str = "ring",
    param_bytes: int | None = None,
    grad_bytes: int = GRAD_REDUCE_BYTES,
    constants: CostConstants | None = None,
) -> CollectivePlan:
    """Each unit's gather and reduce algorithm over the plan's W ranks, ``ranks_per_node`` of them per
    node. ``mode`` (--mfsdp-collectives): ``auto`` takes the fastest predicted (ties to ``parts``),
    except that a reduction in ``rank`` order stays the exact chain; a forced mode applies to both
    directions. ``reduce_order``: resolved (rank or ring). ``param_bytes``: the gather's element
    size (default the plan's). Pure: every rank computes the same from the same plan."""
    if mode not in MODES:
        raise ValueError(f"unknown collectives {mode!r} (--mfsdp-collectives); choose one of {', '.join(MODES)}")
    if reduce_order not in REDUCE_ORDERS:
        raise ValueError(f"reduce order {reduce_order!r}: pass it resolved, one of {REDUCE_ORDERS}")
    topology, c = Topology(plan.world_size, ranks_per_node), constants or constants_for(backend)
    param_bytes = param_bytes or plan.element_size
    units = []
    for layout in plan.units:
        shape = UnitShape.of(layout)
        g_times = algorithm_times(shape, topology, param_bytes, c)
        r_times = algorithm_times(shape, topology, grad_bytes, c)
        gather = reduce = MODE_ALGORITHM.get(mode)
        if mode == "auto":  # the exact rank-order chain (PARTS in rank order) is kept, never replaced
            gather, reduce = fastest(g_times), PARTS if reduce_order == "rank" else fastest(r_times)
        chain = None
        if reduce == PARTS and reduce_order == "rank":
            chain = chain_time(c, topology, shape.numel * CHAIN_SUM_BYTES, shape.max_segment * CHAIN_SUM_BYTES)
        units.append(UnitChoice(layout.index, layout.name, gather, reduce, g_times, r_times, chain))
    return CollectivePlan(plan.world_size, ranks_per_node, backend, mode, reduce_order, tuple(units))


def collective_choices(
    plan: Plan, world: int, ranks_per_node: int, backend: str, mode: str = "auto", reduce_order: str = "ring", **kwargs
) -> dict[int, tuple[str, str]]:
    """Unit index -> (gather algorithm, reduce algorithm) for ``plan`` over ``world`` ranks (its own
    W: checked), as :func:`choose_collectives` (``kwargs``: param_bytes, grad_bytes, constants)."""
    if world != plan.world_size:
        raise ValueError(f"the plan is laid out over {plan.world_size} ranks, not {world}")
    return choose_collectives(plan, ranks_per_node, backend, mode, reduce_order, **kwargs).choices()
