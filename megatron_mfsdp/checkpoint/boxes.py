"""Checkpoint-box geometry: megatron-core's ShardedTensor metadata of a model chunk, and an owner's
flat pieces of it turned into the uneven ShardedTensors this rank saves.

An owner holds element ranges of flattened parameters (a whole matrix, an even slice, or a Q, K or
V block's rows of every query group); megatron's keys and TP offsets come from the module's own
``sharded_state_dict``. Each range becomes at most three boxes per dimension (a partial row, whole
rows, a partial row), which DCP checks for coverage (megatron-core 0.16.1 refuses
``flattened_range``). The runtime supplies the pieces (duck-typed ``LocalPiece``s); nothing here
imports it."""

from __future__ import annotations

import math

import torch


def flat_boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[tuple, tuple, int]]:
    """The flat element range [lo, hi) of a C-contiguous tensor of ``shape`` as boxes
    (offset, size, flat start), in order: a partial leading row, whole rows, a partial last row."""
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi - lo < inner):
        return [
            ((first, *o), (1, *s), first * inner + a)
            for o, s, a in flat_boxes(lo % inner, lo % inner + hi - lo, shape[1:])
        ]
    boxes, begin, end = [], lo, (hi // inner) * inner
    if lo % inner:
        begin = (first + 1) * inner
        boxes += flat_boxes(lo, begin, shape)
    if end > begin:
        boxes.append(((begin // inner, *(0,) * (len(shape) - 1)), ((end - begin) // inner, *shape[1:]), begin))
    if hi > end:
        boxes += flat_boxes(end, hi, shape)
    return boxes


def run_shards(sh, start: int, at: int, data: torch.Tensor, key_prefix: str, replica: int) -> list:
    """ShardedTensors of ``data``, elements [at, at + len) of a flattened parameter, where they fall in
    megatron's tensor ``sh`` (elements [start, ...) of that parameter): at most three boxes per
    dimension (partial row, whole rows, partial row)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    lo = max(start, at) - start
    hi = min(start + math.prod(sh.local_shape), at + data.numel()) - start
    out = []
    for offset, size, pos in flat_boxes(lo, hi, tuple(sh.local_shape)) if lo < hi else ():
        begin, pre = start + pos - at, sh.prepend_axis_num
        # Uneven shards take full-rank shapes: megatron's uneven path ignores prepend_axis_num.
        size = (1,) * pre + size
        out.append(
            ShardedTensor(
                key=key_prefix + sh.key,
                data=data[begin : begin + math.prod(size)].view(size),
                dtype=data.dtype,
                local_shape=size,
                global_shape=sh.global_shape,
                global_offset=(*sh.global_offset[:pre], *(g + o for g, o in zip(sh.global_offset[pre:], offset))),
                axis_fragmentations=None,
                replica_id=(*sh.replica_id[:2], replica),
            )
        )
    return out


BUFFERS = "<buffers>"
"""The :func:`megatron_shards` entry of the module's buffers' ShardedTensors (not a parameter name)."""


@torch.no_grad()
def megatron_shards(module: torch.nn.Module, shapes: dict[str, tuple], metadata=None) -> dict[str, list]:
    """Local parameter name -> [(megatron ShardedTensor, flat start in the TP-local tensor)]:
    megatron-core's own ``sharded_state_dict`` of ``module`` (keys, layer and TP offsets, replica
    ids; SwiGLU fc1 as its two halves), computed on shape-only stand-ins of the parameters named in
    ``shapes`` (their full shapes: a sharded wrapper has released them). Its ShardedTensors of the
    module's buffers (an MoE router's expert bias), on the live buffers, come under the key
    :data:`BUFFERS`: every rank holds them whole, as in megatron-core's checkpoints."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    buffers = {id(b) for b in module.buffers()}
    params = {name: p for name, p in module.named_parameters() if name in shapes}
    names = {id(p): name for name, p in params.items()}

    def stand_in(p, shape):
        return torch.empty((), dtype=p.dtype, device=p.device).expand(shape)

    kept = {name: p.data for name, p in params.items()}
    for name, p in params.items():
        p.data = stand_in(p, shapes[name])
    try:
        sharded = module.sharded_state_dict(prefix="", metadata=metadata)
    finally:
        for name, p in params.items():
            p.data = kept[name]
    out = {BUFFERS: []}
    for sh in sharded.values():
        name = names.get(id(getattr(sh, "data", None)))
        if isinstance(sh, ShardedTensor) and id(sh.data) in buffers:
            out[BUFFERS].append((sh, 0))
        if name is None:
            continue  # _extra_state objects: not tensors, not saved
        parts = [sh]
        if isinstance(sh, ShardedTensorFactory):
            parts = sh.build_fn(sh.key, stand_in(sh.data, shapes[name]), sh.replica_id, None)
        starts = [sum(math.prod(part.local_shape) for part in parts[:i]) for i in range(len(parts))]
        out[name] = list(zip(parts, starts))
    return out


def piece_shards(piece, data: torch.Tensor, shards: list, key_prefix: str, replica: int) -> list:
    """ShardedTensors of one owned piece (``LocalPiece``: a range of a parameter, or a Q, K or V
    block's rows of each query group) whose flat values are ``data`` (weights, a master, a moment),
    cut along megatron's tensor(s) of its parameter (``shards``: its :func:`megatron_shards` entry).
    Keys are ``key_prefix + megatron key``; the DP coordinate of the replica id is ``replica``, the
    rank in the replica group: owners' ranges are disjoint."""
    flat = data.reshape(-1)
    first, run, stride, count = piece.runs()
    out = []
    for k in range(count):
        at, part = first + k * stride, flat[k * run : (k + 1) * run]
        for sh, start in shards:
            out += run_shards(sh, start, at, part, key_prefix, replica)
    if piece.numel and sum(sh.data.numel() for sh in out) != piece.numel:
        raise RuntimeError(
            f"checkpoint shards of {piece.slot.name} cover {sum(s.data.numel() for s in out)} of {piece.numel} elements"
        )
    return out
