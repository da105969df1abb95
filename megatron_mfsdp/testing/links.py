"""Each torch.distributed call charged, at the call site, with the bytes it moves in and out of
this rank as NCCL's ring algorithms move them (runtime/traffic.py's table). ``count_collectives``
records it per call, so a test can hold SegmentComm's own counters, and the start-up prediction,
against what was actually handed to torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.traffic import all_reduce_link, broadcast_link, reduce_link, slices_link


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(kwargs, args, at: int):
    group = kwargs.get("group", args[at] if len(args) > at else None)
    return group if group is not None else dist.group.WORLD


def _root(kwargs, group, which: str) -> int:
    if kwargs.get(f"group_{which}") is not None:
        return kwargs[f"group_{which}"]
    return dist.get_group_rank(group, kwargs[which])


def _all_to_all(args, kwargs, rank, world) -> tuple[int, int]:
    out, inp = args[0], args[1]
    outs = kwargs.get("output_split_sizes") or (args[2] if len(args) > 2 else None)
    ins = kwargs.get("input_split_sizes") or (args[3] if len(args) > 3 else None)
    row_out, row_in = _nbytes(out) // max(1, out.numel()), _nbytes(inp) // max(1, inp.numel())
    outs = outs or [out.numel() // world] * world
    ins = ins or [inp.numel() // world] * world
    return (sum(outs) - outs[rank]) * row_out, (sum(ins) - ins[rank]) * row_in


def link_bytes(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(bytes in, bytes out) of this rank for one call of ``name``; (0, 0) for what moves no tensor
    (object collectives, barriers) or for calls this table does not know."""
    if name in ("isend", "send", "irecv", "recv"):
        n = _nbytes(args[0])
        return (0, n) if name in ("isend", "send") else (n, 0)
    if name == "batch_isend_irecv":
        return tuple(map(sum, zip((0, 0), *(link_bytes(op.op.__name__, (op.tensor,), {}) for op in args[0]))))
    at = {"broadcast": 2, "reduce": 3, "all_reduce": 2, "all_to_all_single": 4}.get(name, 2)
    group = _group(kwargs, args, at)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if name == "broadcast":
        return broadcast_link(_nbytes(args[0]), rank, _root(kwargs, group, "src"), world)
    if name == "reduce":
        return reduce_link(_nbytes(args[0]), rank, _root(kwargs, group, "dst"), world)
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return slices_link(_nbytes(args[1]), world)
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return slices_link(_nbytes(args[0]), world)
    if name == "all_reduce":
        return all_reduce_link(_nbytes(args[0]), world)
    if name == "all_to_all_single":
        return _all_to_all(args, kwargs, rank, world)
    return 0, 0
