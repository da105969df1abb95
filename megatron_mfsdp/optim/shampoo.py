"""Shampoo with Adam grafting (``--optimizer shampoo``), as Distributed Shampoo runs it on a matrix.

Shi et al. 2023, "A Distributed Data-Parallel PyTorch Implementation of the Distributed Shampoo
Optimizer for Training Neural Networks At-Scale" (arXiv:2309.06497); read in facebookresearch/optimizers
``distributed_shampoo/distributed_shampoo.py`` (the step: ``_compute_search_directions``,
``_precondition_and_grafting``, ``_group_step_body``), ``preconditioner/shampoo_preconditioner_list.py``
(factor EMAs, their bias correction, roots -1/(2 * order)) and ``preconditioner/matrix_functions.py``
(``matrix_inverse_root`` by eigh with ``PerturbationConfig``). Megatron-LM has no Shampoo. Per block of
at most ``--shampoo-max-precond-dim`` on a side, with G its gradient block:

- every step: L <- b L + (1 - b) G G^T, R <- b R + (1 - b) G^T G (b = ``--shampoo-beta``; b = 1 sums,
  as Distributed Shampoo's default), and Adam's moments m, v of the whole matrix (``--adam-beta1``,
  ``--adam-beta2``); M = m / (1 - beta1^t) is the filtered gradient both directions precondition;
- at step ``start`` and at every multiple of ``--shampoo-precondition-frequency`` after it: the roots
  (L / (1 - b^t) + eps I)^(-1/4) and likewise of R, by ``torch.linalg.eigh`` in the factors' dtype
  (fp32 in training), eigenvalues below eps shifted up to eps as Distributed Shampoo does;
- the direction: before ``start`` Adam's, A = M / (sqrt(v / (1 - beta2^t)) + eps_adam); from it on,
  S = L^(-1/4) M R^(-1/4) rescaled to A's Frobenius norm per block (layer-wise grafting).

The shell applies decoupled weight decay. Distributed Shampoo's ``momentum`` (iterate averaging) is off
by default there and not offered here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .matrix import MatrixMath, matrix_rule, tp_mode_field

GRAFT_NORM_EPS = 1e-16
"""Added to the Shampoo direction's norm before dividing by it (Distributed Shampoo's constant)."""

EIGH_MULTIPLY_ADDS_X2 = 9
"""Twice the multiply-adds per n^3 of an n x n symmetric eigendecomposition with eigenvectors: Golub and
Van Loan (Matrix Computations, 4th ed., 8.3) count about 9 n^3 flops (tridiagonal reduction, its Q,
the implicit QR sweeps), 4.5 n^3 multiply-adds. Forming Q diag(l^-1/4) Q^T adds n^3."""


@dataclass
class ShampooSettings:
    """Shampoo with Adam grafting, Distributed Shampoo's defaults"""

    shampoo_beta: float = field(
        default=0.999,
        metadata={
            "help": "EMA factor of Shampoo's L = G G^T and R = G^T G statistics; 1 sums them (AdaGrad-like). "
            "Distributed Shampoo's README example for replacing Adam uses 0.999"
        },
    )
    shampoo_epsilon: float = field(
        default=1e-12,
        metadata={"help": "added to L and R (times I) before their inverse 4th roots (Distributed Shampoo's epsilon)"},
    )
    shampoo_precondition_frequency: int = field(
        default=100,
        metadata={"help": "steps between recomputing the inverse roots by eigh (Distributed Shampoo's examples: 100)"},
    )
    shampoo_start_preconditioning_step: int = field(
        default=0,
        metadata={
            "type": int,
            "help": "first step with the Shampoo direction, when the roots are first computed; Adam's direction "
            "before it. 0: --shampoo-precondition-frequency (Distributed Shampoo's -1)",
        },
    )
    shampoo_max_precond_dim: int = field(
        default=8192,
        metadata={
            "help": "a matrix side longer than this is cut into blocks of at most this size, each preconditioned "
            "alone (Distributed Shampoo's max_preconditioner_dim; its README starts at 8192)"
        },
    )
    tp_mode: str = tp_mode_field("shampoo", "Shampoo")

    def __post_init__(self):
        if not 0.0 <= self.shampoo_beta <= 1.0:
            raise ValueError(f"--shampoo-beta {self.shampoo_beta} must be in [0, 1]")
        if not self.shampoo_epsilon > 0.0:
            raise ValueError(f"--shampoo-epsilon {self.shampoo_epsilon} must be positive")
        for flag, value, least in (
            ("--shampoo-precondition-frequency", self.shampoo_precondition_frequency, 1),
            ("--shampoo-start-preconditioning-step", self.shampoo_start_preconditioning_step, 0),
            ("--shampoo-max-precond-dim", self.shampoo_max_precond_dim, 1),
        ):
            if value < least:
                raise ValueError(f"{flag} {value} must be at least {least}")

    @property
    def start(self) -> int:
        """The first preconditioned step (Distributed Shampoo's start_preconditioning_step)."""
        return self.shampoo_start_preconditioning_step or self.shampoo_precondition_frequency

    def refreshes(self, step: int) -> bool:
        """Whether ``step`` recomputes the roots: the first preconditioned step always does, then every
        multiple of the frequency (Distributed Shampoo's perform_amortized_computation)."""
        return step == self.start or (step > self.start and step % self.shampoo_precondition_frequency == 0)


@dataclass(frozen=True)
class ShampooHyper:
    """What :func:`direction` reads: the rule's settings and the Adam graft's betas and eps, which are the
    optimizer config's (``--adam-beta1``, ``--adam-beta2``, ``--adam-eps``), not flags of the rule."""

    settings: ShampooSettings
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @classmethod
    def of(cls, settings: ShampooSettings, config) -> ShampooHyper:
        return cls(settings, config.adam_beta1, config.adam_beta2, config.adam_eps)


def blocks(shape: Sequence[int], max_dim: int) -> list[tuple[slice, slice]]:
    """(rows, cols) slices of each preconditioner block, row-major: each side cut as ``torch.split``
    cuts it into ``max_dim`` (Distributed Shampoo's blocking)."""
    rows, cols = shape
    return [
        (slice(r, min(r + max_dim, rows)), slice(c, min(c + max_dim, cols)))
        for r in range(0, rows, max_dim)
        for c in range(0, cols, max_dim)
    ]


def block_shapes(shape: Sequence[int], max_dim: int) -> list[tuple[int, int]]:
    return [(r.stop - r.start, c.stop - c.start) for r, c in blocks(shape, max_dim)]


def init(shape, settings: ShampooSettings) -> dict[str, Tensor]:
    """Adam's moments of the matrix, and per block k its factors (zero) and their roots (set before use)."""
    state = {"exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
    for k, (rows, cols) in enumerate(block_shapes(shape, settings.shampoo_max_precond_dim)):
        state[f"left_{k}"], state[f"right_{k}"] = torch.zeros(rows, rows), torch.zeros(cols, cols)
        state[f"left_root_{k}"], state[f"right_root_{k}"] = torch.zeros(rows, rows), torch.zeros(cols, cols)
    return state


def inverse_root(factor: Tensor, epsilon: float, root: int = 4) -> Tensor:
    """(factor + eps I)^(-1/root) by eigh in the factor's dtype; eigenvalues below eps (a rank-deficient
    factor's, rounded negative) shifted up so the least is eps (Distributed Shampoo's
    ``matrix_inverse_root_from_eigendecomposition`` with ``perturb_before_computation``)."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    values, vectors = torch.linalg.eigh(factor + epsilon * eye)
    least = values.min()
    values = torch.where(least < epsilon, values - least + epsilon, values)
    return (vectors * values.pow(-1.0 / root)) @ vectors.T


def adam_direction_(grad: Tensor, state: dict[str, Tensor], hyper: ShampooHyper, step: int) -> tuple[Tensor, Tensor]:
    """Updates Adam's moments; returns the filtered gradient M and Adam's direction A (adamw.py's
    arithmetic: the graft is AdamW's update of this gradient)."""
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1 - hyper.beta2)
    filtered = exp_avg / (1 - hyper.beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - hyper.beta2**step)).add_(hyper.eps)
    return filtered, filtered / denom


def update_factors_(grad: Tensor, left: Tensor, right: Tensor, beta: float) -> None:
    weight = 1.0 if beta == 1.0 else 1.0 - beta  # beta = 1 sums (Distributed Shampoo's weighting_factor)
    left.addmm_(grad, grad.T, beta=beta, alpha=weight)
    right.addmm_(grad.T, grad, beta=beta, alpha=weight)


def grafted(shampoo: Tensor, graft: Tensor) -> Tensor:
    """``shampoo`` rescaled to ``graft``'s Frobenius norm."""
    return shampoo.mul_(graft.norm() / (shampoo.norm() + GRAFT_NORM_EPS))


@torch.no_grad()
def direction(grad: Tensor, state: dict[str, Tensor], hyper: ShampooHyper, step: int) -> Tensor:
    """The update direction of one matrix (the module docstring's steps), its state updated in place."""
    s = hyper.settings
    filtered, adam = adam_direction_(grad, state, hyper, step)
    refresh, shampoo = s.refreshes(step), step >= s.start
    correction = 1.0 - s.shampoo_beta**step if s.shampoo_beta < 1.0 else 1.0
    out = torch.empty_like(grad) if shampoo else adam
    # Blocks are copied contiguous (a no-op for one block), so a block's numbers are bitwise those of
    # the block alone: BLAS and norms sum a strided view in another order.
    for k, (rows, cols) in enumerate(blocks(grad.shape, s.shampoo_max_precond_dim)):
        left, right = state[f"left_{k}"], state[f"right_{k}"]
        update_factors_(grad[rows, cols].contiguous(), left, right, s.shampoo_beta)
        if refresh:
            state[f"left_root_{k}"].copy_(inverse_root(left / correction, s.shampoo_epsilon))
            state[f"right_root_{k}"].copy_(inverse_root(right / correction, s.shampoo_epsilon))
        if shampoo:
            preconditioned = state[f"left_root_{k}"] @ filtered[rows, cols].contiguous() @ state[f"right_root_{k}"]
            out[rows, cols] = grafted(preconditioned, adam[rows, cols].contiguous())
    return out


def cost(shape, split_rows, context) -> int:
    """Planner multiply-adds per step, summed over blocks (r x c): the factor updates G G^T and G^T G
    (r^2 c + r c^2, full products as addmm runs them), the preconditioning L^-1/4 M R^-1/4 (the same),
    and the two roots' refresh ((4.5 + 1) (r^3 + c^3), :data:`EIGH_MULTIPLY_ADDS_X2`) amortised over the
    frequency. Adam's elementwise work (a few operations per element) is left out, as Muon's cost does."""
    s = RULE.settings_in(context.config)
    total = 0
    for r, c in block_shapes(shape, s.shampoo_max_precond_dim):
        total += 2 * (r * r * c + r * c * c)
        total += (EIGH_MULTIPLY_ADDS_X2 + 2) * (r**3 + c**3) // (2 * s.shampoo_precondition_frequency)
    return total


def state_bytes(shape, context) -> int:
    """fp32 bytes resident: Adam's two moments, and per block its two factors and their two roots."""
    s = RULE.settings_in(context.config)
    rows, cols = shape
    factors = sum(2 * (r * r + c * c) for r, c in block_shapes(shape, s.shampoo_max_precond_dim))
    return 4 * (2 * rows * cols + factors)


RULE = matrix_rule(
    "shampoo",
    MatrixMath(init=init, direction=direction, hyper=ShampooHyper.of),
    settings=ShampooSettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer="shampoo",
)
