"""Lion (Chen et al., arXiv:2302.06675): the sign of an interpolated momentum, elementwise, so an
even slice of a tensor gets the numbers of the whole tensor on one device.

Megatron-LM HEAD's ``--optimizer lion`` and ``--muon-scalar-optimizer lion`` build Emerging-Optimizers'
``Lion`` (emerging_optimizers/scalar_optimizers/lion.py and update_functions/lion.py, v0.3.0, the
version Megatron-LM pins) with ``betas=(--lion-beta1, --lion-beta2)`` (megatron/core/optimizer/
__init__.py, optimizer_config.py). Per step, in that order:

    param <- param * (1 - lr * wd)                   decoupled weight decay first
    update = sign(lerp(exp_avg, grad, 1 - beta1))    beta1 * m + (1 - beta1) * g
    exp_avg <- lerp(exp_avg, grad, 1 - beta2)        the momentum, with beta2
    param <- param - lr * update

Its one state tensor is ``exp_avg``, the key Megatron's DistributedOptimizer saves for Lion
(megatron/core/optimizer/distrib_optimizer.py), split like the parameter in checkpoints.
Emerging-Optimizers decays by ``param.add_(param, alpha=-lr * wd)``; we multiply by ``1 - lr * wd``
as AdamW and Muon do here (and pytorch_optimizer's Lion): the same number within one rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..placement.classes import SLICE
from .rule import OwnedPiece, StepContext, UpdateRule


@dataclass
class LionSettings:
    """Lion's betas (Megatron-LM HEAD's --lion-beta1/--lion-beta2 and defaults)"""

    lion_beta1: float = field(
        default=0.95, metadata={"help": "Lion: the interpolation of momentum and gradient whose sign is the update"}
    )
    lion_beta2: float = field(default=0.98, metadata={"help": "Lion: the decay of the momentum (exp_avg) EMA"})

    def __post_init__(self):
        for flag, beta in (("--lion-beta1", self.lion_beta1), ("--lion-beta2", self.lion_beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{flag} {beta}: must be in [0, 1)")


@torch.no_grad()
def lion_step_(param, grad, exp_avg, *, lr: float, weight_decay: float, beta1: float, beta2: float) -> None:
    """One Lion step in place on ``param`` and ``exp_avg`` (the order of the module docstring)."""
    param.mul_(1 - lr * weight_decay)
    update = exp_avg.lerp(grad, 1 - beta1).sign_()
    exp_avg.lerp_(grad, 1 - beta2)
    param.add_(update, alpha=-lr)


@torch.no_grad()
def lion_foreach_(params, grads, exp_avgs, *, lr: float, weight_decay: float, beta1: float, beta2: float) -> None:
    """:func:`lion_step_` on lists of tensors with ``torch._foreach_*`` kernels: the same ops in the
    same order per tensor (bitwise equal), one launch per op on CUDA instead of one per piece."""
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
    torch._foreach_add_(params, updates, alpha=-lr)


def _settings(ctx: StepContext) -> LionSettings:
    return ctx.settings if ctx.settings is not None else LionSettings()


def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """Lion on every owned slice at once (:func:`lion_foreach_`)."""
    if not pieces:
        return
    s = _settings(ctx)
    lion_foreach_(
        [p.master for p in pieces],
        [p.grad for p in pieces],
        [p.state["exp_avg"] for p in pieces],
        lr=ctx.lr,
        weight_decay=ctx.weight_decay,
        beta1=s.lion_beta1,
        beta2=s.lion_beta2,
    )


def step_per_piece(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """The loop over pieces, one :func:`lion_step_` each: the reference for :func:`step`."""
    s = _settings(ctx)
    for p in pieces:
        lion_step_(
            p.master,
            p.grad,
            p.state["exp_avg"],
            lr=ctx.lr,
            weight_decay=ctx.weight_decay,
            beta1=s.lion_beta1,
            beta2=s.lion_beta2,
        )


RULE = UpdateRule(name="lion", storage=SLICE, state=("exp_avg",), step=step, settings=LionSettings, optimizer="lion")
