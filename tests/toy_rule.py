"""A toy whole-matrix update rule, written as a plug-in is (CONTRIBUTING.md): this file plus
``registry.register(RULE)``. It keeps state no elementwise rule could (an n x n Gram EMA and a
scalar step count), counts its calls, and has its own planner cost, so the tests can tell that the
registry, the planner, the step and the checkpoints all go through it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_mfsdp.optim.matrix import MatrixMath, matrix_rule

CALLS: list[tuple[int, int]] = []
"""(rows, cols) of every matrix this process's rule stepped, in order."""


@dataclass
class ToySettings:
    """the Gram-preconditioned toy rule's settings"""

    toy_beta: float = field(default=0.9, metadata={"help": "EMA of the n x n Gram factor"})
    tp_mode: str = field(
        default="duplicated", metadata={"flag": "--toy-tp-mode", "choices": ("blockwise", "duplicated")}
    )


def init(shape, settings: ToySettings) -> dict[str, torch.Tensor]:
    rows, cols = shape
    return {"gram": torch.zeros(cols, cols), "count": torch.zeros(())}


def direction(grad: torch.Tensor, state: dict, settings: ToySettings, step: int) -> torch.Tensor:
    CALLS.append(tuple(grad.shape))
    state["gram"].lerp_(grad.T @ grad, 1 - settings.toy_beta)
    state["count"].add_(1)
    g = state["gram"]
    return (grad @ g) / (g.norm() + 1e-8)


def cost(shape, split_rows, context) -> int:
    rows, cols = shape
    return 2 * rows * cols * cols + 7  # + 7: a figure no other rule's cost gives


def state_bytes(shape, context) -> int:
    return 4 * (shape[1] * shape[1] + 1)


RULE = matrix_rule(
    "toy",
    MatrixMath(init=init, direction=direction),
    settings=ToySettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer="toy",
)


def register() -> None:
    """Add the toy rule to this process's registry (once)."""
    from megatron_mfsdp.optim import registry

    if RULE.name not in registry.RULES:
        registry.register(RULE)
