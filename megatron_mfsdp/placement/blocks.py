"""Separate owners for the Q, K and V blocks of a linear_qkv weight: the planner side only.

With --muon-split-qkv (the default) Muon orthogonalizes Q, K and V as three matrices of
(query groups x rows per group, columns) rows, independently, so nothing in the math keeps
them on one rank. Planning them as three items splits the largest attention item in three:
MHA GPT 24x2048 at 64 DP ranks goes from NS max/mean 1.333 to 1.111.

Where a TP shard holds one query group, its Q, K and V are contiguous row ranges of the
weight ('contiguous'); with more groups per shard they interleave per group ('all' plans
them anyway). The runtime does not place blocks apart yet: it keeps every parameter
contiguous in its owner's segment, so a block plan is a preview (tools/plan.py,
benchmarks/bench_planner.py) and never reaches training. What the runtime would need:
slots for row blocks of one parameter (layout.py), the merged weight built after the gather
and the gradient split before the reduction (runtime/), per-block optimizer pieces (Muon on
a plain matrix gives the same numbers as the split step) and checkpoint keys per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .layout import ParamSpec, UnitSpec
from .rules import WHOLE

MODES = ("whole", "contiguous", "all")
"""whole: Q, K, V on one owner (what the runtime does); contiguous: apart where a TP shard
holds one query group; all: apart everywhere."""

BLOCK_NAMES = ("q", "k", "v")


def query_groups(p: ParamSpec) -> int:
    """Query groups in this (TP-local) parameter; 0 if it has no Q/K/V split."""
    if p.storage != WHOLE or not p.split_rows or len(p.split_rows) != 3:
        return 0
    return p.shape[0] // sum(p.split_rows)


def split_qkv_blocks(
    units: Sequence[UnitSpec], mode: str, cost: Callable[[str, tuple[int, ...]], int]
) -> list[UnitSpec]:
    """``units`` with each split linear_qkv replaced by WHOLE specs ``NAME[q]``, ``NAME[k]``,
    ``NAME[v]`` of (groups x rows, columns), where ``mode`` allows; ``cost(rule, shape)`` is
    the rule's planner cost of one block (the registry's). Totals of cost and elements stay."""
    if mode not in MODES:
        raise ValueError(f"unknown Q/K/V owner mode {mode!r}; choose one of {', '.join(MODES)}")
    out = []
    for unit in units:
        params = []
        for p in unit.params:
            groups = query_groups(p)
            if mode == "whole" or not groups or (mode == "contiguous" and groups != 1):
                params.append(p)
                continue
            for block, rows in zip(BLOCK_NAMES, p.split_rows):
                shape = (groups * rows, p.shape[1])
                params.append(ParamSpec(f"{p.name}[{block}]", shape, p.rule, WHOLE, cost(p.rule, shape)))
        out.append(UnitSpec(unit.name, params))
    return out
