"""AdamW with decoupled weight decay: elementwise, so an even slice of a tensor gets
the same numbers as the whole tensor on a single device."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..placement.classes import SLICE
from .rule import OwnedPiece, StepContext, UpdateRule


@torch.no_grad()
def adamw_step_(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    eps: float,
    bias_correction1: float,
    bias_correction2: float,
) -> None:
    """One AdamW step in place on ``param`` and the moments."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


@torch.no_grad()
def adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, *, lr, weight_decay, beta1, beta2, eps, step) -> None:
    """:func:`adamw_step_` on lists of tensors with ``torch._foreach_*`` kernels: the same ops in
    the same order per tensor (bitwise equal), one kernel launch per op on CUDA instead of one
    per piece and op."""
    bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, math.sqrt(bias_correction2))
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr / bias_correction1)


def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """AdamW on every owned slice at once (:func:`adamw_foreach_`)."""
    if not pieces:
        return
    cfg = ctx.config
    adamw_foreach_(
        [p.master for p in pieces],
        [p.grad for p in pieces],
        [p.state["exp_avg"] for p in pieces],
        [p.state["exp_avg_sq"] for p in pieces],
        lr=ctx.lr,
        weight_decay=ctx.weight_decay,
        beta1=cfg.adam_beta1,
        beta2=cfg.adam_beta2,
        eps=cfg.adam_eps,
        step=ctx.step,
    )


def step_per_piece(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """The loop over pieces, one :func:`adamw_step_` each: the reference for :func:`step`."""
    cfg = ctx.config
    beta1, beta2 = cfg.adam_beta1, cfg.adam_beta2
    for p in pieces:
        adamw_step_(
            p.master,
            p.grad,
            p.state["exp_avg"],
            p.state["exp_avg_sq"],
            lr=ctx.lr,
            weight_decay=ctx.weight_decay,
            beta1=beta1,
            beta2=beta2,
            eps=cfg.adam_eps,
            bias_correction1=1 - beta1**ctx.step,
            bias_correction2=1 - beta2**ctx.step,
        )


RULE = UpdateRule(name="adamw", storage=SLICE, state=("exp_avg", "exp_avg_sq"), step=step, optimizer="adam")
