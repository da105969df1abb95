"""SOAP: Adam in the eigenbasis of Shampoo's Kronecker factors (Vyas et al. 2024, arXiv:2409.11321).

``--optimizer soap`` means what it means in Megatron-LM: megatron/core/optimizer/emerging_optimizers.py
(HEAD) runs Emerging-Optimizers' ``SOAP`` (v0.3.0, the version Megatron-LM's uv.lock pins;
emerging_optimizers/soap/soap.py, soap_utils.py, utils/eig.py) with betas from --adam-beta1/2, its
``soap_shampoo_beta`` and ``soap_use_kl_shampoo`` config fields, bias correction on, decoupled weight
decay. Per step t of one (m, n) matrix with gradient G, its math is:

1. Factors: ``L <- lerp(L, G G^T)`` and ``R <- lerp(R, G^T G)`` with the shampoo beta bias-corrected,
   ``1 - (1 - b) / (1 - b^t)`` (so step 1 takes G G^T whole). KL-Shampoo (arXiv:2509.03378) instead
   takes ``G Q_R diag(1 / (n max(l_R, eps))) Q_R^T G^T`` for L (and the mirror for R), l the factors'
   eigenvalues estimated in the current basis before the update.
2. Eigenbasis, on refresh steps: step 1 ``torch.linalg.eigh`` (descending); later ones sort the basis
   by the estimated eigenvalues of the updated factors (permuting Adam's second moment alike), then one
   power iteration ``Q <- QR(K Q)``. The first moment lives in the basis: it is rotated to the new one
   (back to the parameter's basis, then forward); the second moment is only permuted.
3. Adam on ``Q_L^T G Q_R`` with bias correction, ``m_hat / (sqrt(v_hat) + eps)``, projected back.

Megatron-LM refreshes every step; ``--soap-precondition-frequency`` refreshes every k-th step (steps
1, 1 + k, ...) as the paper amortises it, the factors still updating every step. A side longer than
``--soap-max-precond-dim`` keeps no factor: its basis is the identity, and under KL-Shampoo its
factor counts as the identity (the other side's correction is ``I / dim``). Factors, eigh and QR run
in fp32 on the matrix's owner (eigh falls back to fp64 where fp32 fails, as Emerging-Optimizers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .matrix import MatrixMath, matrix_rule, tp_mode_field

NAME = "soap"
SIDES = (("L", "Q_L"), ("R", "Q_R"))
"""(factor, basis) state names of the row side (m x m) and the column side (n x n)."""


@dataclass
class SoapSettings:
    """SOAP, Adam in Shampoo's eigenbasis (--optimizer soap)"""

    soap_shampoo_beta: float = field(
        default=0.95,
        metadata={"help": "EMA decay of the Kronecker factors, bias-corrected (Megatron-LM's soap_shampoo_beta)"},
    )
    soap_use_kl_shampoo: bool = field(
        default=True,
        metadata={"help": "KL-Shampoo factors, each side weighted by the other's inverse (Megatron-LM's default)"},
    )
    soap_precondition_frequency: int = field(
        default=1,
        metadata={"help": "refresh the eigenbasis (one QR power iteration) every this many steps; 1 is Megatron-LM's"},
    )
    soap_max_precond_dim: int = field(
        default=10000,
        metadata={
            "help": "a side longer than this keeps no factor and an identity basis (the SOAP reference code's "
            "default; Megatron-LM has no limit: set it above every dimension to precondition all)"
        },
    )
    tp_mode: str = tp_mode_field("soap", "SOAP")

    def __post_init__(self):
        if not 0 <= self.soap_shampoo_beta < 1:
            raise ValueError(f"--soap-shampoo-beta must be in [0, 1), got {self.soap_shampoo_beta}")
        for flag, value in (
            ("--soap-precondition-frequency", self.soap_precondition_frequency),
            ("--soap-max-precond-dim", self.soap_max_precond_dim),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass(frozen=True)
class SoapStep:
    """What one step reads: the rule's settings, with Adam's betas and eps from the optimizer config
    (:func:`step_hyper`)."""

    settings: SoapSettings
    beta1: float
    beta2: float
    eps: float


def init(shape, settings: SoapSettings) -> dict[str, Tensor]:
    """Zero moments, zero factors and identity bases (Emerging-Optimizers' start); no factor on a side
    longer than --soap-max-precond-dim."""
    rows, cols = (int(d) for d in shape)
    state = {"exp_avg": torch.zeros(rows, cols), "exp_avg_sq": torch.zeros(rows, cols)}
    for (factor, basis), dim in zip(SIDES, (rows, cols)):
        if dim <= settings.soap_max_precond_dim:
            state[factor], state[basis] = torch.zeros(dim, dim), torch.eye(dim)
    return state


def project(x: Tensor, state: dict[str, Tensor]) -> Tensor:
    """``Q_L^T x Q_R``: into the eigenbasis (an absent side is the identity)."""
    if "Q_L" in state:
        x = state["Q_L"].T @ x
    return x @ state["Q_R"] if "Q_R" in state else x


def project_back(x: Tensor, state: dict[str, Tensor]) -> Tensor:
    """``Q_L x Q_R^T``: back to the parameter's basis."""
    if "Q_L" in state:
        x = state["Q_L"] @ x
    return x @ state["Q_R"].T if "Q_R" in state else x


def shampoo_beta(beta: float, step: int) -> float:
    """The factors' EMA decay at 1-based ``step``, bias-corrected as Emerging-Optimizers' SOAP does."""
    return 1 - (1 - beta) / (1 - beta**step)


def kl_weights(state: dict[str, Tensor], side: int, dim: int, eps: float, like: Tensor) -> Tensor:
    """KL-Shampoo's weights of one side, ``1 / (dim * max(l, eps))`` with l = diag(Q^T K Q), its
    factor's eigenvalues estimated in its basis before this step's update; ``1 / dim`` on a side with
    no factor (the identity)."""
    factor, basis = SIDES[side]
    if factor not in state:
        return like.new_full((dim,), 1.0 / dim)
    q = state[basis]
    eigenvalues = (q * (state[factor] @ q)).sum(0)
    return 1 / (dim * eigenvalues.clamp_min(eps))


def factor_terms(grad: Tensor, state: dict[str, Tensor], kl: bool, eps: float) -> dict[str, Tensor]:
    """This step's new term of each factor (step 1 of the module docstring), both computed before
    either factor moves: G G^T and G^T G, or KL-Shampoo's ``B diag(w_R) B^T`` with B = G Q_R and
    ``A^T diag(w_L) A`` with A = Q_L^T G."""
    rows, cols = grad.shape
    terms = {}
    if "L" in state:
        if kl:
            b = grad @ state["Q_R"] if "Q_R" in state else grad
            terms["L"] = (b * kl_weights(state, 1, cols, eps, grad)) @ b.T
        else:
            terms["L"] = grad @ grad.T
    if "R" in state:
        if kl:
            a = state["Q_L"].T @ grad if "Q_L" in state else grad
            terms["R"] = (a.T * kl_weights(state, 0, rows, eps, grad)) @ a
        else:
            terms["R"] = grad.T @ grad
    return terms


def eigenvectors(factor: Tensor) -> Tensor:
    """Eigenvectors by descending eigenvalue (``torch.linalg.eigh``; in fp64 where fp32 fails)."""
    try:
        _, vectors = torch.linalg.eigh(factor)
    except (torch.linalg.LinAlgError, RuntimeError):
        _, vectors = torch.linalg.eigh(factor.double())
        vectors = vectors.to(factor.dtype)
    return vectors.flip(-1)


def refresh_(state: dict[str, Tensor], first: bool) -> None:
    """Step 2 of the module docstring, in place: eigh of the factors at the first step; later, each
    basis sorted by its factor's estimated eigenvalues (the second moment permuted alike) and refined by
    one QR power iteration, the first moment rotated from the old basis to the new one."""
    if first:  # the moments are still zero: nothing to rotate or permute
        for factor, basis in SIDES:
            if factor in state:
                state[basis].copy_(eigenvectors(state[factor]))
        return
    exp_avg = project_back(state["exp_avg"], state)
    for side, (factor, basis) in enumerate(SIDES):
        if factor in state:
            q = state[basis]
            power = state[factor] @ q
            order = torch.argsort((q * power).sum(0), descending=True, stable=True)
            state["exp_avg_sq"].copy_(state["exp_avg_sq"].index_select(side, order))
            q.copy_(torch.linalg.qr(power[:, order]).Q)
    state["exp_avg"].copy_(project(exp_avg, state))


def refreshes(step: int, frequency: int) -> bool:
    """Whether 1-based ``step`` refreshes the eigenbasis: steps 1, 1 + frequency, 1 + 2 frequency, ..."""
    return (step - 1) % frequency == 0


def direction(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, step: int) -> Tensor:
    """One SOAP step of one matrix (the module docstring's steps 1-3): the update direction, the state
    updated in place. The shell applies decoupled weight decay and the learning rate."""
    s = hyper.settings
    beta = shampoo_beta(s.soap_shampoo_beta, step)
    for name, term in factor_terms(grad, state, s.soap_use_kl_shampoo, hyper.eps).items():
        state[name].lerp_(term, 1 - beta)
    if refreshes(step, s.soap_precondition_frequency):
        refresh_(state, first=step == 1)
    projected = project(grad, state)
    state["exp_avg"].lerp_(projected, 1 - hyper.beta1)
    state["exp_avg_sq"].lerp_(projected.square(), 1 - hyper.beta2)
    m_hat = state["exp_avg"] / (1 - hyper.beta1**step)
    v_hat = state["exp_avg_sq"] / (1 - hyper.beta2**step)
    return project_back(m_hat / (v_hat.sqrt() + hyper.eps), state)


def qr_multiply_adds(dim: int) -> int:
    """Multiply-adds of a Householder QR of a dim x dim matrix with Q formed: 2 d^3 / 3 for R and as
    many for Q (LAPACK geqrf + orgqr), an estimate: the planner's, not a count."""
    return 4 * dim**3 // 3


def step_multiply_adds(shape: Sequence[int], settings: SoapSettings) -> tuple[int, int]:
    """(every step, each refresh) multiply-adds of one (m, n) matrix: the matrix products
    :func:`direction` runs (tests/unit/test_soap_math.py counts them) plus, in a refresh, one
    :func:`qr_multiply_adds` per preconditioned side. The first step's eigh (once a run) is left out.
    Every step: the factor terms (m n (m + n); twice that plus the factors' K Q under KL-Shampoo), the
    gradient into the basis and the update out of it (2 m n (m + n)); a refresh: the first moment out
    and back in (2 m n (m + n)), K Q and QR per side."""
    m, n = (int(d) for d in shape[-2:])
    pm, pn = m <= settings.soap_max_precond_dim, n <= settings.soap_max_precond_dim
    proj = pm * m * m * n + pn * m * n * n
    if settings.soap_use_kl_shampoo:
        factors = pm * (pn * (m * n * n + n**3) + m * m * n) + pn * (pm * (m * m * n + m**3) + n * n * m)
    else:
        factors = pm * m * m * n + pn * n * n * m
    refresh = 2 * proj + sum(d**3 + qr_multiply_adds(d) for d, kept in ((m, pm), (n, pn)) if kept)
    return int(factors + 2 * proj), int(refresh)


def cost(shape, split_rows, context) -> int:
    """Planner multiply-adds per step: every step's, plus a refresh amortised over the frequency."""
    settings = RULE.settings_in(context.config)
    every, refresh = step_multiply_adds(shape, settings)
    return every + refresh // settings.soap_precondition_frequency


def state_bytes(shape, context) -> int:
    """fp32 words held: both moments (2 m n), and per preconditioned side its factor and basis (2 d^2)."""
    settings = RULE.settings_in(context.config)
    m, n = (int(d) for d in shape[-2:])
    sides = sum(2 * d * d for d in (m, n) if d <= settings.soap_max_precond_dim)
    return 4 * (2 * m * n + sides)


def step_hyper(settings: SoapSettings, config) -> SoapStep:
    """What :func:`direction` reads (MatrixMath.hyper): the settings with --adam-beta1, --adam-beta2 and
    --adam-eps of the optimizer config."""
    return SoapStep(settings, config.adam_beta1, config.adam_beta2, config.adam_eps)


RULE = matrix_rule(
    NAME,
    MatrixMath(init=init, direction=direction, hyper=step_hyper),
    settings=SoapSettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer=NAME,
    elementwise="adamw",  # as Megatron-LM routes an emerging optimizer's non-matrix parameters to Adam
)
