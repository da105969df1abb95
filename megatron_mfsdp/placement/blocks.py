"""Separate owners for the Q, K and V blocks of a linear_qkv weight (--mfsdp-split-qkv-owners).

With --muon-split-qkv (the default) Muon orthogonalizes Q, K and V as three matrices of
(query groups x rows per group, columns) rows, independently, so nothing in the math keeps
them on one rank. Planning them as three items splits the largest attention item in three:
MHA GPT 24x2048 at 64 DP ranks goes from NS max/mean 1.600 to 1.067 (bytes 1.306 to 1.102).

Each block becomes a slot of its own, owned, stored, reduced and stepped like any matrix: its
rows of every query group of the TP shard (``param``, and runs of ``param_run`` elements,
``param_stride`` apart, from ``param_start``; one run where the shard holds one group). The
runtime builds the merged weight from the three after each gather and hands each owner its
block's rows of the gradient; the optimizer steps a block as the split step steps it (its own
rows per group as ``split_rows``, so the op order is the split step's); checkpoints keep
megatron's key for the whole weight, each block saving its rows. 'contiguous' places blocks
apart only where a shard holds one group (each block one row range: the merge is one copy of
contiguous parts); 'all' also where groups interleave them (MHA; GQA with several groups per
shard): the same mechanism, with a run per group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .classes import WHOLE
from .layout import ParamSpec, UnitSpec

MODES = ("whole", "contiguous", "all")
"""whole: Q, K, V on one owner; contiguous: apart where a TP shard holds one query group;
all: apart everywhere."""

BLOCK_NAMES = ("q", "k", "v")


def query_groups(p: ParamSpec) -> int:
    """Query groups in this (TP-local) parameter; 0 if it has no Q/K/V split."""
    if p.storage != WHOLE or not p.split_rows or len(p.split_rows) != 3:
        return 0
    return p.shape[0] // sum(p.split_rows)


def split_qkv_blocks(
    units: Sequence[UnitSpec],
    mode: str,
    cost: Callable[[str, tuple[int, ...]], int],
    state_bytes: Callable[[str, tuple[int, ...]], int] | None = None,
) -> list[UnitSpec]:
    """``units`` with each split linear_qkv replaced by WHOLE specs ``NAME[q]``, ``NAME[k]``,
    ``NAME[v]`` of (groups x rows, columns), where ``mode`` allows; ``cost(rule, shape)`` and
    ``state_bytes(rule, shape)`` are the rule's planner cost and resident state of one block (the
    registry's). Totals of cost and elements stay.
    A block is its rows of every query group: runs of ``param_run`` elements, ``param_stride``
    apart, from ``param_start`` (one run where a shard holds one group)."""
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
            cols, first_row, period = p.shape[1], 0, sum(p.split_rows) * p.shape[1]
            for block, rows in zip(BLOCK_NAMES, p.split_rows):
                shape = (groups * rows, cols)
                runs = (first_row * cols, rows * cols, period)  # its rows in each query group
                held = state_bytes(p.rule, shape) if state_bytes else 0
                spec = ParamSpec(
                    f"{p.name}[{block}]", shape, p.rule, WHOLE, cost(p.rule, shape), (rows,), p.name, *runs
                )
                spec.state_bytes = held
                params.append(spec)
                first_row += rows
        out.append(UnitSpec(unit.name, params))
    return out
