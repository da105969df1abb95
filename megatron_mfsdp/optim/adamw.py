"""AdamW with decoupled weight decay: elementwise, so an even slice of a tensor gets
the same numbers as the whole tensor on a single device."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..placement.rules import SLICE
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


def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
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
