"""Reconstruction Muon: Muon on ordinary ZeRO-3 even flat shards (``--mfsdp-layout even``).

The paper's baseline in our own runtime. Every matrix is stored as even slices of its unit's flat
buffer, so no rank holds it whole. Each step, per matrix and in the same order on every rank: the
rank updates the momentum of its slice (elementwise, so the numbers are the owner's), the Nesterov
directions of the slices are gathered over the DP shard group into the full matrix (every rank
joins, also one that holds none of it), every rank runs Newton-Schulz on it with muon.py's math,
and each keeps the slice of the update it holds. The gather moves exactly the matrix's elements
(``all_to_all_single`` with uneven splits: each rank sends its slice to every rank), no padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..groups import group_rank, group_size
from ..placement.classes import SLICE
from .muon import apply_update_, momentum_direction_, scaled_update, splits_qkv, step_kwargs
from .rule import GroupMatrix, OwnedPiece, StepContext, UpdateRule


def gather_slices(local: Tensor, bounds: Sequence[int], group) -> Tensor:
    """The flat parameter whose slice [bounds[r], bounds[r + 1]) rank r holds, on every rank of
    ``group``: one all_to_all_single that sends this rank's slice to each rank (exact bytes)."""
    world = len(bounds) - 1
    if world == 1:
        return local.reshape(-1)
    counts = [bounds[r + 1] - bounds[r] for r in range(world)]
    out = torch.empty(bounds[-1], dtype=local.dtype, device=local.device)
    send = local.reshape(-1).repeat(world)
    dist.all_to_all_single(out, send, counts, [local.numel()] * world, group=group)
    return out


def _direction(piece: OwnedPiece | None, momentum: float, nesterov: bool, device) -> Tensor:
    if piece is None:
        return torch.empty(0, dtype=torch.float32, device=device)
    return momentum_direction_(piece.grad, piece.state["momentum_buffer"], momentum, nesterov)


@torch.no_grad()
def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """Momentum on the local slice, the full direction gathered, Newton-Schulz on every rank, the
    local slice of the update applied: per matrix, the numbers of muon.muon_step_ on the whole."""
    kwargs = step_kwargs(ctx)
    lr, weight_decay = kwargs.pop("lr"), kwargs.pop("weight_decay")
    momentum, nesterov = kwargs.pop("momentum"), kwargs.pop("nesterov")
    local = {p.global_name: p for p in pieces}
    if len(local) != len(pieces):
        raise ValueError("muon_even: a rank holds two slices of one parameter; the layout is not even ZeRO-3")
    rank = group_rank(ctx.dp_group)
    device = pieces[0].master.device if pieces else group_device(ctx.dp_group)
    for m in ctx.matrices:
        _check(m, group_size(ctx.dp_group))
        piece = local.get(m.global_name)
        full = gather_slices(_direction(piece, momentum, nesterov, device), m.bounds, ctx.dp_group)
        update, alpha = scaled_update(full.view(m.shape), lr, qkv_split_shapes=m.split_rows, **kwargs)
        if piece is not None:
            mine = update.reshape(-1)[m.bounds[rank] : m.bounds[rank + 1]]
            apply_update_(piece.master, mine, alpha, lr, weight_decay)


def group_device(group) -> torch.device:
    """Where a rank that holds no slice makes its empty send buffer: NCCL needs a CUDA tensor."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check(m: GroupMatrix, world: int) -> None:
    if len(m.shape) != 2 or len(m.bounds) != world + 1:
        raise ValueError(
            f"muon_even: {m.global_name} of shape {m.shape} with {len(m.bounds) - 1} shard bounds over a DP "
            f"shard group of {world}; it needs a 2D matrix split over that group"
        )


RULE = UpdateRule(
    name="muon_even",
    storage=SLICE,
    state=("momentum_buffer",),
    step=step,
    even_layout_of="muon",
    splits_qkv=splits_qkv,
    collective=True,
)
