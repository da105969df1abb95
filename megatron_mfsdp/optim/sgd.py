"""SGD with momentum and coupled weight decay, as megatron-core builds it for --optimizer sgd
(torch.optim.SGD(lr, weight_decay, momentum=--sgd-momentum)): elementwise, so it runs on any
even slice; the same op order as torch.optim.SGD's single-tensor path (bitwise in the tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..placement.classes import SLICE
from .rule import OwnedPiece, StepContext, UpdateRule


@torch.no_grad()
def sgd_step_(param, grad, momentum_buffer, *, lr: float, weight_decay: float, momentum: float, first: bool) -> None:
    """One step in place: d = grad + wd * param; buf = momentum * buf + d (buf = d at first); param -= lr * buf."""
    d = grad.add(param, alpha=weight_decay) if weight_decay != 0 else grad
    if momentum != 0:
        if first:
            momentum_buffer.copy_(d)
        else:
            momentum_buffer.mul_(momentum).add_(d)
        d = momentum_buffer
    param.add_(d, alpha=-lr)


def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    momentum = ctx.config.sgd_momentum
    for p in pieces:
        sgd_step_(
            p.master,
            p.grad,
            p.state["momentum_buffer"],
            lr=ctx.lr,
            weight_decay=ctx.weight_decay,
            momentum=momentum,
            first=ctx.step == 1,
        )


RULE = UpdateRule(name="sgd", storage=SLICE, state=("momentum_buffer",), step=step, optimizer="sgd")
