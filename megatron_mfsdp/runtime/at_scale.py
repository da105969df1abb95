"""Every rank's side of the unit collectives at any W, in one process.

torch's ``fake`` process-group backend answers every call at once and leaves tensors alone, so a
plan for 1024 ranks can be driven through the real ``SegmentComm`` rank by rank, on meta tensors
(shapes only, nothing allocated): the real planner's layouts, the real calls, the comm's own
per-call charges. What this shows: the torch.distributed calls per unit operation, each rank's
bytes in and out (held against runtime/traffic.py's prediction from the layout), the busiest rank
against ZeRO-3's bytes per rank, and the largest buffer a gather or reduction allocates. What it
cannot show: time, NCCL's algorithm and protocol choice, the concurrency of grouped calls.
tools/plan.py --traffic prints it, per shard domain (dense over DP, experts over expert DP);
tests/unit/test_traffic_at_scale.py checks it at cluster scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..groups import ProcessGroups
from ..node_levels import new_levels
from ..placement.layout import Plan, UnitLayout
from .call_log import count_collectives
from .comm import PARTS, SegmentComm
from .traffic import add, algorithm_links, busiest, owner_parts, per_level, zero3_bytes


@dataclass(frozen=True)
class Collectives:
    """Which algorithms the simulated comm runs (SegmentComm.choose) on which node layout."""

    algorithms: dict | None = None  # unit index -> (gather, reduce); None: parts
    force: tuple = (None, None)  # (gather, reduce) for every unit, or None
    ranks_per_node: int | None = None  # the simulated node size (None: one node)

    def chosen(self, unit: int, reduce: bool) -> str:
        return self.force[reduce] or (self.algorithms or {}).get(unit, (PARTS, PARTS))[reduce]


@dataclass
class UnitScale:
    """One unit's collectives over every rank of the plan."""

    index: int
    name: str
    numel: int
    parts: int  # non-empty owner parts (one broadcast or reduce each)
    gather_calls: int  # torch.distributed calls of one gather, most on any rank
    reduce_calls: int  # ... of one reduction
    gather_busiest: int  # bytes: the busiest rank's larger direction in one gather
    reduce_busiest: int
    zero3_gather: int  # ZeRO-3's bytes per rank, each way, for the same all-gather
    zero3_reduce: int  # ... reduce-scatter
    transient: int  # the largest buffer (bytes) any rank allocated for the unit (gathered weights, packed
    # gradient, staging), to hold against the unit's fp32 gradient
    as_predicted: bool | None  # every rank's charges equal runtime/traffic.py's prediction (None: no
    # prediction, an algorithm other than parts)
    gather_levels: dict | None = None  # level (flat, intra, inter) -> the busiest rank's larger direction
    reduce_levels: dict | None = None


def _one_rank(plan: Plan, units: Sequence[int], rank: int, dtypes, order: str, routes: dict, how: Collectives) -> dict:
    """(calls, per-level links, transient) per unit operation of ``rank``, on the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    param_dtype, grad_dtype = dtypes
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=FakeStore())
    try:
        groups = ProcessGroups(dp=dist.group.WORLD, dp_shard=dist.group.WORLD)
        levels = None
        if how.ranks_per_node:
            levels = new_levels([tuple(range(plan.world_size))], dist.group.WORLD, how.ranks_per_node)
        comm = SegmentComm(groups, verify=False, reduce_order=order, levels=levels)
        comm.choose(how.algorithms or {}, how.force)  # in rank order a per-unit reduce but parts raises
        comm.routes = routes  # the same for every rank: built once, not W times
        out = {}
        for i in units:
            layout: UnitLayout = plan.units[i]
            comm.log, comm.transient = [], 0
            segment = torch.empty(layout.segment_numel(rank), dtype=param_dtype, device="meta")
            with count_collectives() as gather:
                comm.start_gather(layout, segment, "forward").wait()
            comm.device = segment.device
            packed = comm.pack_grads(layout, {}, grad_dtype, 1.0)  # the runtime's own buffer, zeros
            with count_collectives() as reduce:
                comm.start_reduce(layout, packed).wait()
            links = [per_level([e for e in comm.log if e.op == op]) for op in ("gather", "reduce")]
            out[i] = (len(gather), len(reduce), links, comm.transient)
        return out
    finally:
        dist.destroy_process_group()


def _total(levels: dict) -> tuple[int, int]:
    total = (0, 0)
    for link in levels.values():
        total = add(total, link)
    return total


def _busiest_per_level(ranks: list[dict]) -> dict:
    """Level -> the busiest rank's larger direction, over every rank's per-level links."""
    return {level: busiest([r.get(level, (0, 0)) for r in ranks]) for level in sorted({k for r in ranks for k in r})}


def simulate(
    plan: Plan, units: Sequence[int], param_dtype, grad_dtype, order: str, how: Collectives | None = None
) -> list[UnitScale]:
    """Drive ``units`` of ``plan`` through every rank's SegmentComm ('rank' or 'ring' reduce order; ``how``:
    the algorithms and the simulated node layout, default parts on one node)."""
    if dist.is_initialized():
        raise RuntimeError("simulate() starts fake process groups; call it where no process group exists")
    how = how or Collectives()
    w, routes = plan.world_size, {}
    ranks = [_one_rank(plan, units, r, (param_dtype, grad_dtype), order, routes, how) for r in range(w)]
    pe, ge = torch.empty(0, dtype=param_dtype).element_size(), torch.empty(0, dtype=grad_dtype).element_size()
    rows = []
    for i in units:
        layout = plan.units[i]
        gathers, reduces = [_total(r[i][2][0]) for r in ranks], [_total(r[i][2][1]) for r in ranks]
        per_node = how.ranks_per_node or w
        g, r = how.chosen(i, False), how.chosen(i, True)
        predicted = gathers == algorithm_links(layout, pe, g, per_node) and reduces == algorithm_links(
            layout, ge, r, per_node, order
        )
        rows.append(
            UnitScale(
                i,
                layout.name,
                layout.numel,
                len(owner_parts(layout)),
                max(r[i][0] for r in ranks),
                max(r[i][1] for r in ranks),
                busiest(gathers),
                busiest(reduces),
                zero3_bytes(layout.numel, pe, w),
                zero3_bytes(layout.numel, ge, w),
                max(r[i][3] for r in ranks),
                predicted,
                _busiest_per_level([r[i][2][0] for r in ranks]),
                _busiest_per_level([r[i][2][1] for r in ranks]),
            )
        )
    return rows
