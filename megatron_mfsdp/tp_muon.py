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

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .muon import merge_qkv, muon_step_, newton_schulz, ns_coefficients_for, split_qkv, update_scale

TP_MODES = ("blockwise", "distributed", "duplicated")


def _full_shape(local: Sequence[int], dim: int, tp_size: int):
    shape = list(local)
    shape[dim] *= tp_size
    return tuple(shape)


def _all_gather_along(x: Tensor, dim: int, group) -> Tensor:
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1), group=group)
    return torch.cat(list(out.view((world,) + tuple(x.shape)).unbind(0)), dim=dim)


def distributed_newton_schulz(x_local: Tensor, split_dim: int, group, steps: int, coefficients: str,
                              ns_dtype: torch.dtype, eps: float = 1e-7) -> Tensor:
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
    for step, (a, b, c) in enumerate(ns_coefficients_for(coefficients, steps)):
        if step:
            g = gram(x)
        poly = torch.addmm(g, g, g, beta=b, alpha=c)
        x = torch.addmm(x, x, poly, beta=a) if split_dim == 0 else torch.addmm(x, poly, x, beta=a)
    return x.float().contiguous()


@torch.no_grad()
def tp_muon_step_(param: Tensor, grad: Tensor, momentum_buffer: Tensor, *, mode: str, tp_group,
                  partition_dim: Optional[int], lr: float, weight_decay: float, momentum: float,
                  nesterov: bool, ns_steps: int, coefficients: str, ns_dtype: torch.dtype, scale_mode: str,
                  extra_scale_factor: float, qkv_split_shapes: Optional[Sequence[int]] = None) -> None:
    """One Muon step on this rank's TP shard (see the module docstring for the modes)."""
    kwargs = dict(ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype, scale_mode=scale_mode,
                  extra_scale_factor=extra_scale_factor, qkv_split_shapes=qkv_split_shapes)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if mode == "blockwise" or partition_dim is None or tp_size == 1:
        muon_step_(param, grad, momentum_buffer, lr=lr, weight_decay=weight_decay, momentum=momentum,
                   nesterov=nesterov, **kwargs)
        return
    if mode not in TP_MODES:
        raise ValueError(f"unknown --muon-tp-mode {mode!r}; choose one of {', '.join(TP_MODES)}")
    if qkv_split_shapes is not None and partition_dim != 0:
        raise ValueError("a QKV matrix must be column-parallel (partition_dim 0) to split Q, K, V under TP")
    momentum_buffer.lerp_(grad, 1 - momentum)
    direction = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    tp_rank = dist.get_rank(tp_group)
    if mode == "duplicated":
        full = _all_gather_along(direction, partition_dim, tp_group)
        # The same op order as muon_step_ on the full matrix, then keep our slice.
        if qkv_split_shapes is None:
            update_full = newton_schulz(full, ns_steps, coefficients, ns_dtype)
            alpha = -lr * update_scale(tuple(full.shape), scale_mode, extra_scale_factor)
        else:
            from .muon import muon_orthogonalized_update

            update_full = muon_orthogonalized_update(full, **kwargs)
            alpha = -lr
        update = update_full.chunk(tp_size, dim=partition_dim)[tp_rank]
    else:
        blocks = split_qkv(direction, qkv_split_shapes) if qkv_split_shapes is not None else [direction]
        parts = []
        for block in blocks:
            full_shape = _full_shape(block.shape, partition_dim, tp_size)
            scale = update_scale(full_shape, scale_mode, extra_scale_factor)
            parts.append(distributed_newton_schulz(block, partition_dim, tp_group, ns_steps, coefficients,
                                                   ns_dtype).mul_(scale))
        update = merge_qkv(parts, qkv_split_shapes, tuple(direction.shape)) if qkv_split_shapes else parts[0]
        alpha = -lr
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=alpha)
