"""Muon on a tensor-parallel-sharded matrix owned by this data-parallel rank.

The owner DP rank is the same on every TP rank (the plan is identical across
TP), so the TP shards of an owned matrix sit on exactly one megatron TP group,
and the TP ranks of that group step their shards together. Three modes, as in
megatron-core's ``muon_tp_mode``:

- ``blockwise``: Newton-Schulz on the local shard; no communication, but the
  result depends on the TP size (each shard is orthogonalized on its own).
- ``duplicated``: all-gather the momentum direction over TP, run full-matrix
  Muon on every TP rank, keep the local slice: equals TP=1.
- ``distributed``: full-matrix Newton-Schulz with the shards left in place.
  ``p(X X^T) X = X p(X^T X)``, so with rows split (column-parallel) each rank
  updates ``X_i <- a X_i + X_i (b G + c G^2)`` with ``G = sum_i X_i^T X_i``, and with
  columns split (row-parallel) ``X_i <- a X_i + (b G + c G^2) X_i`` with
  ``G = sum_i X_i X_i^T``: one all-reduce of the Gram matrix per iteration (the
  first also gives the Frobenius norm, its trace). The scale uses the full shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..placement.classes import WHOLE
from .matrix import gather_over_tp
from .muon import (
    apply_update_,
    merge_qkv,
    momentum_direction_,
    muon_step_,
    ns_coefficients_for,
    rule_cost,
    scaled_update,
    split_qkv,
    splits_qkv,
    step_kwargs,
    update_scale,
)
from .rule import OwnedPiece, StepContext, UpdateRule

TP_MODES = ("blockwise", "distributed", "duplicated")


def _full_shape(local: Sequence[int], dim: int, tp_size: int):
    shape = list(local)
    shape[dim] *= tp_size
    return tuple(shape)


def distributed_newton_schulz(
    x_local: Tensor, split_dim: int, group, steps: int, coefficient_type: str, ns_dtype: torch.dtype, eps: float = 1e-7
) -> Tensor:
    """Newton-Schulz of the matrix whose shards along ``split_dim`` are spread over
    ``group``; returns this rank's shard of the result (fp32)."""
    x = x_local.float().to(ns_dtype)

    def gram(m: Tensor) -> Tensor:
        g = (m.T @ m if split_dim == 0 else m @ m.T).float()
        dist.all_reduce(g, group=group)
        return g.to(ns_dtype)

    g = gram(x)
    norm = g.float().diagonal().sum().clamp(min=0).sqrt().clamp(min=eps)
    x = x / norm.to(ns_dtype)
    g = g / (norm * norm).to(ns_dtype)
    for step, (a, b, c) in enumerate(ns_coefficients_for(coefficient_type, steps)):
        if step:
            g = gram(x)
        poly = torch.addmm(g, g, g, beta=b, alpha=c)
        x = torch.addmm(x, x, poly, beta=a) if split_dim == 0 else torch.addmm(x, poly, x, beta=a)
    return x.float().contiguous()


@torch.no_grad()
def tp_muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    mode: str,
    tp_group,
    partition_dim: int | None,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    coefficient_type: str,
    ns_dtype: torch.dtype,
    scale_mode: str,
    extra_scale_factor: float,
    qkv_split_shapes: Sequence[int] | None = None,
    ns_algorithm: str = "standard",
) -> None:
    """One Muon step on this rank's TP shard (see the module docstring for the modes)."""
    kwargs = dict(
        ns_steps=ns_steps,
        coefficient_type=coefficient_type,
        ns_dtype=ns_dtype,
        ns_algorithm=ns_algorithm,
        scale_mode=scale_mode,
        extra_scale_factor=extra_scale_factor,
        qkv_split_shapes=qkv_split_shapes,
    )
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if mode == "blockwise" or partition_dim is None or tp_size == 1:
        muon_step_(
            param,
            grad,
            momentum_buffer,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            **kwargs,
        )
        return
    if mode not in TP_MODES:
        raise ValueError(f"unknown --muon-tp-mode {mode!r}; choose one of {', '.join(TP_MODES)}")
    if qkv_split_shapes is not None and partition_dim != 0:
        raise ValueError("a QKV matrix must be column-parallel (partition_dim 0) to split Q, K, V under TP")
    direction = momentum_direction_(grad, momentum_buffer, momentum, nesterov)
    if mode == "duplicated":
        # The same op order as muon_step_ on the full matrix, then keep our slice.
        update_full, alpha = scaled_update(gather_over_tp(direction, partition_dim, tp_group), lr, **kwargs)
        update = update_full.chunk(tp_size, dim=partition_dim)[dist.get_rank(tp_group)]
    else:
        update, alpha = _distributed_update(direction, partition_dim, tp_group, tp_size, **kwargs), -lr
    apply_update_(param, update, alpha, lr, weight_decay)


def _distributed_update(
    direction: Tensor,
    partition_dim: int,
    tp_group,
    tp_size: int,
    *,
    ns_steps: int,
    coefficient_type: str,
    ns_dtype: torch.dtype,
    scale_mode: str,
    extra_scale_factor: float,
    qkv_split_shapes: Sequence[int] | None,
    ns_algorithm: str = "standard",
) -> Tensor:
    """Scaled full-matrix Newton-Schulz of each block (Q, K, V or the whole), shards in place.
    Always the standard iteration (``ns_algorithm`` is not used): its all-reduced quantity is
    the Gram matrix of the sharded X, which a Gram-space iteration would need only once."""
    blocks = split_qkv(direction, qkv_split_shapes) if qkv_split_shapes is not None else [direction]
    parts = []
    for block in blocks:
        scale = update_scale(_full_shape(block.shape, partition_dim, tp_size), scale_mode, extra_scale_factor)
        parts.append(
            distributed_newton_schulz(block, partition_dim, tp_group, ns_steps, coefficient_type, ns_dtype).mul_(scale)
        )
    return merge_qkv(parts, qkv_split_shapes, tuple(direction.shape)) if qkv_split_shapes else parts[0]


def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    kwargs = step_kwargs(ctx)
    for p in pieces:
        tp_muon_step_(
            p.master,
            p.grad,
            p.state["momentum_buffer"],
            mode=ctx.config.muon_tp_mode,
            tp_group=ctx.tp_group,
            partition_dim=p.partition_dim,
            qkv_split_shapes=p.split_rows,
            **kwargs,
        )


def check(piece: OwnedPiece, cfg) -> None:
    if cfg.muon_tp_mode != "blockwise" and piece.partition_dim not in (0, 1):
        raise ValueError(
            f"--muon-tp-mode {cfg.muon_tp_mode}: {piece.name} is tensor-parallel "
            "but its split dimension (partition_dim) is unknown; use blockwise"
        )


RULE = UpdateRule(
    name="muon_tp",
    storage=WHOLE,
    state=("momentum_buffer",),
    step=step,
    cost=rule_cost,
    check=check,
    splits_qkv=splits_qkv,
)
