"""What every whole-matrix rule shares, so that a new one (SOAP, Shampoo, a toy) is its math alone.

A matrix rule is written as :class:`MatrixMath`: the state of one matrix of a given shape and the
update direction from its gradient and state. :func:`matrix_rule` turns it into the owner rule and
its ``--mfsdp-layout even`` variant:

- On its owner the step runs the math on the whole matrix and applies the direction with decoupled
  weight decay: no collective on tensor data.
- Tensor parallelism, by the rule's ``tp_mode`` setting: ``blockwise`` runs the math on the TP-local
  shard (its own state, no communication; the numbers depend on the TP size); ``duplicated``
  all-gathers the gradient over TP, runs the math on the whole matrix with the whole matrix's state
  (the same on every TP rank) and keeps the local slice of the direction: the numbers of TP = 1.
- The even variant (the reconstruction baseline) gathers each matrix's gradient slices over the DP
  shard group, runs the same math on every rank that holds a slice (each keeping the whole matrix's
  state, replicated) and keeps its slice of the direction: the owner's numbers, with the gathers and
  the replicated state the owner layout avoids.

State that is not shaped like the parameter is checkpointed whole under its matrix's name
(optimizer.py ``_matrix_states``), so any DP, PP or (in ``duplicated`` mode) TP layout reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..compat.collectives import all_gather_single
from ..groups import group_rank
from ..placement.classes import SLICE, WHOLE
from .muon_even import gather_slices, group_device
from .rule import OwnedPiece, StepContext, UpdateRule

TP_MODES = ("blockwise", "duplicated")
"""Tensor-parallel modes every matrix rule has (Muon adds megatron-core's ``distributed``)."""


@dataclass(frozen=True)
class MatrixMath:
    """One whole-matrix optimizer, as math on a single matrix."""

    init: Callable[[tuple[int, int], object], dict[str, Tensor]]
    """The state of one matrix of this (rows, cols) shape under these settings: tensors of any shape."""
    direction: Callable[[Tensor, dict[str, Tensor], object, int], Tensor]
    """(fp32 gradient, state, hyper, 1-based step) -> the update direction, shaped like the gradient;
    updates the state in place. The step applies ``param -= lr * (direction + weight_decay * param)``."""
    hyper: Callable[[object, object], object] | None = None
    """(the rule's settings, the optimizer config) -> what ``direction`` gets as its third argument, for a
    rule that also reads shared flags (--adam-beta1/2, --adam-eps); None: the settings."""


def settings_in(config, name: str, settings: type):
    """A rule's settings in an optimizer config (its ``rule_settings``), its defaults if absent."""
    return getattr(config, "rule_settings", {}).get(name) or settings()


def gather_over_tp(x: Tensor, dim: int, group) -> Tensor:
    """The whole matrix of which each rank of the TP ``group`` holds the shard ``x`` along ``dim``."""
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous().view(-1), group=group)
    return torch.cat(list(out.view((world,) + tuple(x.shape)).unbind(0)), dim=dim)


def apply_decoupled_(master: Tensor, direction: Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then the step along ``direction`` (AdamW's and Muon's order)."""
    master.mul_(1 - lr * weight_decay)
    master.add_(direction.view_as(master), alpha=-lr)


def _whole_shape(piece: OwnedPiece) -> tuple[int, int]:
    return piece.full_shape if piece.state_over_tp else tuple(piece.param_shape or piece.master.shape)


@dataclass(frozen=True)
class _MatrixSteps:
    """The functions an UpdateRule of ``math`` needs, bound to its name and settings class."""

    name: str
    math: MatrixMath
    settings: type

    def init(self, piece: OwnedPiece, s) -> dict[str, Tensor]:
        return {k: v.to(piece.master.device) for k, v in self.math.init(_whole_shape(piece), s).items()}

    def hyper(self, ctx: StepContext):
        settings = ctx.settings if ctx.settings is not None else self.settings()
        return settings if self.math.hyper is None else self.math.hyper(settings, ctx.config)

    @torch.no_grad()
    def step(self, pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
        hyper = self.hyper(ctx)
        for p in pieces:
            if p.state_over_tp:  # duplicated: the whole matrix's direction, our slice of it
                whole = gather_over_tp(p.grad, p.partition_dim, ctx.tp_group)
                direction = self.math.direction(whole, p.state, hyper, ctx.step)
                direction = direction.chunk(p.tp_size, dim=p.partition_dim)[p.tp_rank]
            else:
                direction = self.math.direction(p.grad, p.state, hyper, ctx.step)
            apply_decoupled_(p.master, direction, ctx.lr, ctx.weight_decay)

    @torch.no_grad()
    def even_step(self, pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
        local, hyper = {p.global_name: p for p in pieces}, self.hyper(ctx)
        rank = group_rank(ctx.dp_group)
        device = pieces[0].master.device if pieces else group_device(ctx.dp_group)
        for m in ctx.matrices:  # the same order on every rank: each gather is joined by all
            piece = local.get(m.global_name)
            grad = piece.grad if piece is not None else torch.empty(0, device=device)
            whole = gather_slices(grad, m.bounds, ctx.dp_group).view(m.shape)
            if piece is not None:
                direction = self.math.direction(whole, piece.state, hyper, ctx.step).reshape(-1)
                apply_decoupled_(piece.master, direction[m.bounds[rank] : m.bounds[rank + 1]], ctx.lr, ctx.weight_decay)

    def check(self, piece: OwnedPiece, config) -> None:
        mode = settings_in(config, self.name, self.settings).tp_mode
        if mode not in TP_MODES:
            raise ValueError(f"{self.name}: tp_mode {mode!r}; choose one of {', '.join(TP_MODES)}")

    def over_tp(self, config) -> bool:
        return settings_in(config, self.name, self.settings).tp_mode == "duplicated"


def matrix_rule(
    name: str,
    math: MatrixMath,
    *,
    settings: type,
    cost: Callable,
    state_bytes: Callable,
    optimizer: str | None = None,
    elementwise: Callable[[object], str] | str | None = "adamw",
) -> UpdateRule:
    """The owner rule of ``math``, its even variant in ``even``. ``settings`` must have a ``tp_mode``
    field (one of :data:`TP_MODES`); ``cost`` and ``state_bytes`` are the planner's (shape,
    split_rows, CostContext) -> multiply-adds and (shape, CostContext) -> bytes."""
    if "tp_mode" not in {f.name for f in dataclasses.fields(settings)}:
        raise TypeError(f"matrix rule {name!r}: its settings {settings.__name__} need a tp_mode field")
    steps = _MatrixSteps(name, math, settings)
    even = UpdateRule(
        name=f"{name}_even",
        storage=SLICE,
        state=steps.init,
        step=steps.even_step,
        state_bytes=state_bytes,  # per holder: every rank that holds a slice keeps the whole state
        even_layout_of=name,
        collective=True,
        family=name,
    )
    return UpdateRule(
        name=name,
        storage=WHOLE,
        state=steps.init,
        step=steps.step,
        cost=cost,
        state_bytes=state_bytes,
        settings=settings,
        optimizer=optimizer,
        elementwise=elementwise,
        check=steps.check,
        state_over_tp=steps.over_tp,
        even=even,
    )
