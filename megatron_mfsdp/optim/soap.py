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

The order above (``--soap-basis current``, the default) is Megatron-LM's, and its first steps follow
the gradient's rounding: at step 1 the basis is the gradient's own singular vectors, so
``Q_L^T G Q_R`` is diagonal but for fp32 rounding, and while a factor is rank-deficient (a rectangular
matrix's long side) the gradient's components on its null space are rounding too; Adam's
bias-corrected first step divides each entry by its own magnitude, so rounding becomes +-1.
``--soap-basis previous`` is the SOAP paper's order (its reference code, github.com/nikhilvyas/SOAP
soap.py ``step``): the gradient is projected into the basis built from the gradients before it, then
the factors and the basis take it; step 1 has no basis yet and makes no update (direction 0, the
moments stay 0), so Adam's count, for its bias correction, is ``step - 1``. What fp32 cannot resolve
is then decided without rounding:

- A factor K's resolution is ``dim * eps_fp32 * ||K||_F``, the size of the rounding of a product with K.
- Where an eigenvalue (the first refresh's eigh) or a pivot (later refreshes: ``|R_jj|`` of the power
  iteration's QR) is below it, that column of the basis is not determined by the factor (its null
  space: directions no gradient has reached, or reached below fp32's resolution). Those columns are
  replaced by a fixed completion of the resolved ones: the leading eigenvectors of ``P D P``, P the
  projector onto the unresolved space and D = diag(dim, ..., 1) / dim in the parameter's coordinates,
  a continuous function of the resolved columns. Only a rank-deficient refresh pays for it (a complete
  QR and an eigh of the unresolved dimension); the planner's cost leaves it out, as it leaves out the
  first step's eigh. Under KL-Shampoo a rectangular matrix's long side stays unresolved for its first
  ~150 steps (measured on a 96 x 32 matrix, gradients of 1e-2); plain Shampoo factors for
  ceil(long / short) steps. In either order, step 1's KL weights, of a zero factor, are 1 / (dim eps):
  that 96 x 32 matrix's L is then G G^T / (32 eps), largest eigenvalue 7e4, and step 2's term is
  ~1e-8, below its fp32 rounding (its 33rd eigenvalue is 3e-3, rounding) until the EMA forgets step 1.
- The sort by estimated eigenvalue counts the estimates below the resolution as equal (a stable sort
  keeps their order), and KL-Shampoo's weights clamp the estimates at the resolution (not only at
  eps), so unresolved directions weigh the same whatever rounding made of them.

Measured in tests/unit/test_soap_math.py (``test_update_follows_the_gradient_not_its_rounding``): a
1e-7 relative change of the gradients moves Megatron-LM's update by 130% at step 1 and up to 100x at
steps 2-3 of a rank-deficient start; ``previous``'s by at most 4e-4 at every step (KL-Shampoo).

Why ``current`` stays the default: on benchmarks/bench_quality.py (benchmarks/results/quality.md)
``previous`` reached a best validation loss of 4.69 against ``current``'s 4.52. Under KL-Shampoo a
rectangular matrix's long side is mostly unresolved for its first ~150 steps (above): there
Megatron-LM's basis is made of rounding, new at every refresh, and ``previous``'s is fixed; the fixed one trained
worse (ablations at lr 3e-3, final validation loss: ``current`` 4.53, the paper's order alone 4.55,
with the completion and the sort 4.65, with the KL clamp too 4.69; the completion carried over from the
previous basis instead of recomputed: 4.69; the resolution at sqrt(dim) instead of dim: 4.67).
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
BASES = ("previous", "current")
"""--soap-basis: the basis a step projects its gradient into (the module docstring)."""


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
    soap_basis: str = field(
        default="current",
        metadata={
            "choices": BASES,
            "help": "the eigenbasis each gradient is projected into. current (default): the basis updated with "
            "the gradient first, Megatron-LM's (Emerging-Optimizers') order and numbers, whose first steps' update "
            "follows the gradient's rounding; previous: the basis of the gradients before it, the SOAP paper's order "
            "(its step 1 makes no update), with the directions fp32 cannot resolve given a fixed basis: the update "
            "follows the gradient, not its rounding, but trains worse here (benchmarks/results/quality.md)",
        },
    )

    def __post_init__(self):
        if not 0 <= self.soap_shampoo_beta < 1:
            raise ValueError(f"--soap-shampoo-beta must be in [0, 1), got {self.soap_shampoo_beta}")
        for flag, value in (
            ("--soap-precondition-frequency", self.soap_precondition_frequency),
            ("--soap-max-precond-dim", self.soap_max_precond_dim),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.soap_basis not in BASES:
            raise ValueError(f"--soap-basis must be one of {', '.join(BASES)}, got {self.soap_basis!r}")


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
    """``Q_L^T x Q_R``: into the eigenbasis (an absent side is the identity). Every function here takes one
    matrix, or a (B, rows, cols) stack with its state stacked alike (:func:`batched`)."""
    if "Q_L" in state:
        x = state["Q_L"].mT @ x
    return x @ state["Q_R"] if "Q_R" in state else x


def project_back(x: Tensor, state: dict[str, Tensor]) -> Tensor:
    """``Q_L x Q_R^T``: back to the parameter's basis."""
    if "Q_L" in state:
        x = state["Q_L"] @ x
    return x @ state["Q_R"].mT if "Q_R" in state else x


def shampoo_beta(beta: float, step: int) -> float:
    """The factors' EMA decay at 1-based ``step``, bias-corrected as Emerging-Optimizers' SOAP does."""
    return 1 - (1 - beta) / (1 - beta**step)


def resolution(factor: Tensor) -> Tensor:
    """``dim * eps * ||K||_F`` of a factor K: the size of the rounding of a product with it, below which
    its eigenvalues, estimates and QR pivots are not resolved (the module docstring; the rank tolerance
    of numpy's matrix_rank, with the Frobenius norm to bound the products' rounding)."""
    return torch.linalg.matrix_norm(factor) * factor.shape[-1] * torch.finfo(factor.dtype).eps


def estimates(state: dict[str, Tensor], side: int) -> Tensor:
    """A factor's eigenvalues estimated in its basis, ``diag(Q^T K Q)``."""
    factor, basis = SIDES[side]
    q = state[basis]
    return (q * (state[factor] @ q)).sum(-2)


def kl_weights(
    state: dict[str, Tensor], side: int, dim: int, eps: float, like: Tensor, resolved: bool = False
) -> Tensor:
    """KL-Shampoo's weights of one side, ``1 / (dim * max(l, eps))`` with l = diag(Q^T K Q), its
    factor's eigenvalues estimated in its basis before this step's update; ``1 / dim`` on a side with
    no factor (the identity). ``resolved`` (--soap-basis previous) clamps l at the factor's
    :func:`resolution` too, so that unresolved directions weigh the same."""
    factor, _ = SIDES[side]
    if factor not in state:
        return like.new_full((dim,), 1.0 / dim)
    floor = resolution(state[factor]).clamp_min(eps).unsqueeze(-1) if resolved else eps
    return 1 / (dim * estimates(state, side).clamp_min(floor))


def factor_terms(
    grad: Tensor, state: dict[str, Tensor], kl: bool, eps: float, resolved: bool = False
) -> dict[str, Tensor]:
    """This step's new term of each factor (step 1 of the module docstring), both computed before
    either factor moves: G G^T and G^T G, or KL-Shampoo's ``B diag(w_R) B^T`` with B = G Q_R and
    ``A^T diag(w_L) A`` with A = Q_L^T G (``resolved``: :func:`kl_weights`)."""
    rows, cols = grad.shape[-2:]
    terms = {}
    if "L" in state:
        if kl:
            b = grad @ state["Q_R"] if "Q_R" in state else grad
            terms["L"] = (b * kl_weights(state, 1, cols, eps, grad, resolved).unsqueeze(-2)) @ b.mT
        else:
            terms["L"] = grad @ grad.mT
    if "R" in state:
        if kl:
            a = state["Q_L"].mT @ grad if "Q_L" in state else grad
            terms["R"] = (a.mT * kl_weights(state, 0, rows, eps, grad, resolved).unsqueeze(-2)) @ a
        else:
            terms["R"] = grad.mT @ grad
    return terms


def eigenvectors(factor: Tensor) -> Tensor:
    """Eigenvectors by descending eigenvalue (``torch.linalg.eigh``; in fp64 where fp32 fails)."""
    return eigh_descending(factor)[1]


def each(decompose, x: Tensor) -> tuple[Tensor, ...]:
    """``decompose`` (eigh, QR) of a matrix, or of each matrix of a stack, stacked back: a stack's
    decompositions run one by one (on CUDA a batched QR or eigh of large matrices measured slower than
    the loop: benchmarks/results/batched_directions.md); only the products around them are stacked."""
    if x.dim() == 2:
        return tuple(decompose(x))
    return tuple(torch.stack(parts) for parts in zip(*(decompose(m) for m in x.unbind(0))))


def qr(x: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.qr`` (reduced) of a matrix or, one by one, of a stack (:func:`each`)."""
    return each(torch.linalg.qr, x)


def eigh_descending(factor: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues and eigenvectors by descending eigenvalue (``torch.linalg.eigh``; in fp64 where fp32
    fails, as Emerging-Optimizers' eigh_with_fallback; a stack's one by one, :func:`each`)."""
    if factor.dim() == 3:
        return each(eigh_descending, factor)
    try:
        values, vectors = torch.linalg.eigh(factor)
    except (torch.linalg.LinAlgError, RuntimeError):
        values, vectors = torch.linalg.eigh(factor.double())
        values, vectors = values.to(factor.dtype), vectors.to(factor.dtype)
    return values.flip(-1), vectors.flip(-1)


def complete_(basis: Tensor, kept: Tensor) -> Tensor:
    """``basis`` with its columns outside ``kept`` replaced by the fixed completion of the kept ones (the
    module docstring): the leading eigenvectors of ``P D P``, P the projector onto the kept columns'
    orthogonal complement, D = diag(dim, ..., 1) / dim, found as ``N V`` with N any orthonormal basis
    of the complement (a complete QR's last columns) and V the eigenvectors of ``N^T D N`` (the same
    for every N). In place; returned."""
    missing = int((~kept).sum())
    if missing == 0:
        return basis
    dim = basis.shape[0]
    complement = torch.linalg.qr(basis[:, kept], mode="complete").Q[:, dim - missing :]
    ramp = torch.arange(dim, 0, -1, dtype=basis.dtype, device=basis.device) / dim
    weighted = complement.T @ (complement * ramp[:, None])
    basis[:, ~kept] = complement @ eigh_descending((weighted + weighted.T) / 2)[1]
    return basis


def resolved_eigenbasis(factor: Tensor) -> Tensor:
    """The first refresh of --soap-basis previous: eigh, the eigenvectors of eigenvalues below the
    factor's :func:`resolution` completed (:func:`complete_`; per matrix of a stack)."""
    values, vectors = eigh_descending(factor)
    kept = values > resolution(factor).unsqueeze(-1)
    if factor.dim() == 2:
        return complete_(vectors.contiguous(), kept)
    vectors = vectors.contiguous()
    for i in (~kept).any(-1).nonzero().flatten().tolist():
        complete_(vectors[i], kept[i])
    return vectors


def resolved_qr(power: Tensor, factor: Tensor) -> Tensor:
    """A later refresh of --soap-basis previous: QR of the power iteration ``K Q``; where a pivot
    ``|R_jj|`` is below the factor's :func:`resolution`, QR of the resolved columns alone, the rest
    completed (:func:`complete_`; per matrix of a stack, the rest of the stack's QR kept)."""
    q, r = qr(power)
    kept = r.diagonal(dim1=-2, dim2=-1).abs() > resolution(factor).unsqueeze(-1)
    if bool(kept.all()):
        return q
    if power.dim() == 3:
        for i in (~kept).any(-1).nonzero().flatten().tolist():
            q[i] = resolved_qr(power[i], factor[i])
        return q
    basis = torch.empty_like(q)
    basis[:, kept] = torch.linalg.qr(power[:, kept]).Q
    return complete_(basis, kept)


def permuted(x: Tensor, order: Tensor, axis: int) -> Tensor:
    """``x`` with its rows (``axis`` -2) or columns (-1) in ``order``; per matrix of a stack."""
    if x.dim() == 2:
        return x.index_select(axis + 2, order)
    index = order.unsqueeze(-1 if axis == -2 else -2).expand_as(x)
    return torch.gather(x, axis, index)


def refresh_(state: dict[str, Tensor], first: bool, resolved: bool = False) -> None:
    """Step 2 of the module docstring, in place: eigh of the factors at the first step; later, each
    basis sorted by its factor's estimated eigenvalues (the second moment permuted alike) and refined by
    one QR power iteration, the first moment rotated from the old basis to the new one. ``resolved``
    (--soap-basis previous): what fp32 cannot resolve decided without rounding (the module docstring)."""
    if first:  # the moments are still zero: nothing to rotate or permute
        for factor, basis in SIDES:
            if factor in state:
                new = resolved_eigenbasis(state[factor]) if resolved else eigenvectors(state[factor])
                state[basis].copy_(new)
        return
    exp_avg = project_back(state["exp_avg"], state)
    for side, (factor, basis) in enumerate(SIDES):
        if factor in state:
            q, k = state[basis], state[factor]
            power = k @ q
            est = (q * power).sum(-2)
            if resolved:  # estimates below the resolution count as equal: the stable sort keeps their order
                est = est.clamp_min(resolution(k).unsqueeze(-1))
            order = torch.argsort(est, dim=-1, descending=True, stable=True)
            state["exp_avg_sq"].copy_(permuted(state["exp_avg_sq"], order, side - 2))
            power = permuted(power, order, -1)
            q.copy_(resolved_qr(power, k) if resolved else qr(power)[0])
    state["exp_avg"].copy_(project(exp_avg, state))


def refreshes(step: int, frequency: int) -> bool:
    """Whether 1-based ``step`` refreshes the eigenbasis: steps 1, 1 + frequency, 1 + 2 frequency, ..."""
    return (step - 1) % frequency == 0


def adam_in_basis(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, count: int) -> Tensor:
    """Step 3 of the module docstring: Adam on the gradient projected into the current basis, its
    moments' ``count``-th update (bias correction), projected back."""
    projected = project(grad, state)
    state["exp_avg"].lerp_(projected, 1 - hyper.beta1)
    state["exp_avg_sq"].lerp_(projected.square(), 1 - hyper.beta2)
    m_hat = state["exp_avg"] / (1 - hyper.beta1**count)
    v_hat = state["exp_avg_sq"] / (1 - hyper.beta2**count)
    return project_back(m_hat / (v_hat.sqrt() + hyper.eps), state)


def update_basis_(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, step: int, resolved: bool) -> None:
    """Steps 1 and 2 of the module docstring: the factors take ``grad``, then the basis is refreshed on
    refresh steps."""
    s = hyper.settings
    beta = shampoo_beta(s.soap_shampoo_beta, step)
    for name, term in factor_terms(grad, state, s.soap_use_kl_shampoo, hyper.eps, resolved).items():
        state[name].lerp_(term, 1 - beta)
    if refreshes(step, s.soap_precondition_frequency):
        refresh_(state, first=step == 1, resolved=resolved)


def direction(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, step: int) -> Tensor:
    """One SOAP step of one matrix: the update direction, the state updated in place. --soap-basis
    current (Megatron-LM's order, the default): factors and basis take the gradient, then Adam in the new
    basis; previous (the paper's): Adam in the basis so far (none at step 1: direction 0), then
    factors and basis take the gradient. The shell applies decoupled weight decay and the learning rate."""
    if hyper.settings.soap_basis == "current":
        update_basis_(grad, state, hyper, step, resolved=False)
        return adam_in_basis(grad, state, hyper, step)
    out = torch.zeros_like(grad) if step == 1 else adam_in_basis(grad, state, hyper, step - 1)
    update_basis_(grad, state, hyper, step, resolved=True)
    return out


def batched(grads: Tensor, states: Sequence[dict[str, Tensor]], hyper: SoapStep, step: int) -> Tensor:
    """:func:`direction` of a (B, rows, cols) stack of same-shape matrices (MatrixMath.batched): each state
    tensor stacked, the rotations, factor terms, QR and eigh run as stacked products (a rank-deficient
    refresh completes its unresolved columns per matrix), the state written back."""
    stacked = {name: torch.stack([s[name] for s in states]) for name in states[0]}
    out = direction(grads, stacked, hyper, step)
    for i, s in enumerate(states):
        for name, tensor in s.items():
            tensor.copy_(stacked[name][i])
    return out


def qr_multiply_adds(dim: int) -> int:
    """Multiply-adds of a Householder QR of a dim x dim matrix with Q formed: 2 d^3 / 3 for R and as
    many for Q (LAPACK geqrf + orgqr), an estimate: the planner's, not a count."""
    return 4 * dim**3 // 3


def step_multiply_adds(shape: Sequence[int], settings: SoapSettings) -> tuple[int, int]:
    """(every step, each refresh) multiply-adds of one (m, n) matrix: the matrix products
    :func:`direction` runs (tests/unit/test_soap_math.py counts them) plus, in a refresh, one
    :func:`qr_multiply_adds` per preconditioned side. The first step's eigh (once a run) is left out,
    and so is --soap-basis previous's completion of a rank-deficient refresh (:func:`complete_`).
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
    # batched_on=(): stacked, SOAP measured no faster on CUDA (its per-matrix QR dominates; 64 of 512 x 1408:
    # 1.04x, 0.84x in the paper's order), and its first steps amplify the stacked products' rounding into
    # another update (benchmarks/results/batched_directions.md). The hook stays for the bench and the tests.
    MatrixMath(init=init, direction=direction, hyper=step_hyper, batched=batched, batched_on=()),
    settings=SoapSettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer=NAME,
    elementwise="adamw",  # as Megatron-LM routes an emerging optimizer's non-matrix parameters to Adam
)
