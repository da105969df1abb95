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
on the matrix's owner, in fp32 in Megatron-LM's order (eigh falls back to fp64 where fp32 fails, as
Emerging-Optimizers), in fp64 in the default order (below).

Two orders (``--soap-basis``). ``current`` is Megatron-LM's, above, with its numbers; its first steps
follow the gradient's rounding: at step 1 the basis is the gradient's own singular vectors, so
``Q_L^T G Q_R`` is diagonal but for fp32 rounding, and while a factor is rank-deficient (a rectangular
matrix's long side) the gradient's components on its null space are rounding too; Adam's
bias-corrected first step divides each entry by its own magnitude, so rounding becomes +-1.

``previous`` (the default) is the SOAP paper's order (its reference code, github.com/nikhilvyas/SOAP
soap.py ``step``): the gradient is projected into the basis built from the gradients before it, then
the factors and the basis take it; step 1 has no basis yet and makes no update (direction 0, the
moments stay 0), so Adam's count, for its bias correction, is ``step - 1``. Its update is a
function of the gradient, not of its rounding:

- Factors and bases are kept in fp64, and every product with them runs in fp64 (Adam's moments stay
  fp32). The gradient arrives in fp32, so what a factor resolves is set by the gradient's precision:
  a factor K's resolution is ``dim * eps_fp32 * ||K||_F``. In fp32 the factors' own rounding is of
  that size, and the basis directions near it (the first steps of every rectangular matrix, and
  near-tied eigenvalues) swing with an ulp of the gradient.
- Where an eigenvalue (the first refresh's eigh) or a pivot (later refreshes: ``|R_jj|`` of the power
  iteration's QR) is below the resolution, that column of the basis is not determined by the factor
  (its null space: directions no gradient has reached, or reached below the gradient's precision).
  Those columns are replaced by a fixed completion of the resolved ones: the leading eigenvectors of
  ``P D P``, P the projector onto the unresolved space and D = diag(dim, ..., 1) / dim in the
  parameter's coordinates, a continuous function of the resolved columns. Only a rank-deficient refresh
  pays for it (a complete QR and an eigh of the unresolved dimension); the planner's cost leaves it
  out, as it leaves out the first step's eigh.
- KL-Shampoo's eigenvalue estimates start from a prior, as its paper's fixed point suggests: a factor
  with no history counts as the identity at the gradient's RMS, and the prior fades through the EMA,
  ``l = lerp(diag(Q^T K Q), rms(G_t), b^(t-1))`` (b the shampoo beta), clamped at the resolution. From
  zero factors (Megatron-LM's 1 / (dim eps) weights) the first gradient's terms are ~1e8 / dim times
  the later ones, so a rectangular matrix's long side stays unresolved for its first ~100-150 steps
  and its basis is the fixed completion; with the prior it is resolved within 5-8 steps.
- The basis is not sorted by estimated eigenvalue before the power iteration (orthogonal iteration
  orders its columns by itself, continuously; the second moment stays where it is): sorted, the
  update moved by up to 8.9e-4 under the test's change below (32 x 64, step 3), unsorted by 5e-5, and
  keeping estimates within 1e-4 to 1e-2 of each other in their order did not help.

Measured in tests/unit/test_soap_math.py (``test_update_follows_the_gradient_not_its_rounding``): a
1e-7 relative change of the gradients moves Megatron-LM's update by 130% at step 1 and up to 100x at
steps 2-3 of a rank-deficient start; ``previous``'s by at most 5e-5 at every step. On
benchmarks/bench_quality.py (benchmarks/results/quality.md) ``previous`` reached a best validation loss
of 4.38 against ``current``'s 4.52; the same order in fp32 with zero factors (this file before
issue 27's end) 4.69, with the prior and the sort in fp32 4.35 but a 1e-7 change of the gradient moved
its update by up to 4e-2. fp64 costs the factors' and bases' memory twice (``state_bytes``) and time: on this
2-core CPU, 8 matrices of 512 x 1408 stepped in 7.9 s against Megatron-LM's order's 1.8 s (steps 2-4,
whose refreshes are rank-deficient and pay the completion; benchmarks/results/batched_directions.md).
On GPUs whose fp64 rate is their fp32 rate without TF32 (H100, H200: 67 TFLOPS each) the products
should cost about the same; not measured there.
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
        default="previous",
        metadata={
            "choices": BASES,
            "help": "the eigenbasis each gradient is projected into. previous (default): the basis of the gradients "
            "before it, the SOAP paper's order (its step 1 makes no update), factors in fp64 resolved at the "
            "gradient's precision: the update follows the gradient, not its rounding; current: the basis updated "
            "with the gradient first, Megatron-LM's (Emerging-Optimizers') order and numbers, whose first steps' "
            "update follows the gradient's rounding",
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


def factor_dtype(settings: SoapSettings) -> torch.dtype:
    """The factors' and bases' dtype: fp32 as Megatron-LM in --soap-basis current, fp64 in previous (the
    module docstring)."""
    return torch.float64 if settings.soap_basis == "previous" else torch.float32


def state_dtype(state: dict[str, Tensor]) -> torch.dtype:
    """The dtype the rotations run in: the bases' (the moments' where no side keeps a basis)."""
    return next((state[basis].dtype for _, basis in SIDES if basis in state), state["exp_avg"].dtype)


def init(shape, settings: SoapSettings) -> dict[str, Tensor]:
    """Zero moments (fp32), zero factors and identity bases (Emerging-Optimizers' start) in
    :func:`factor_dtype`; no factor on a side longer than --soap-max-precond-dim."""
    rows, cols = (int(d) for d in shape)
    state = {"exp_avg": torch.zeros(rows, cols), "exp_avg_sq": torch.zeros(rows, cols)}
    dtype = factor_dtype(settings)
    for (factor, basis), dim in zip(SIDES, (rows, cols)):
        if dim <= settings.soap_max_precond_dim:
            state[factor], state[basis] = torch.zeros(dim, dim, dtype=dtype), torch.eye(dim, dtype=dtype)
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


@dataclass(frozen=True)
class Resolve:
    """How --soap-basis previous decides what the gradient does not: ``precision``, the gradient's dtype,
    sets the :func:`resolution`; KL-Shampoo's eigenvalue estimates start from ``prior`` (the gradient's
    RMS, per matrix of a stack) with ``weight`` shampoo_beta^(t-1)."""

    precision: torch.dtype
    prior: Tensor
    weight: float


def resolution(factor: Tensor, precision: torch.dtype | None = None) -> Tensor:
    """``dim * eps * ||K||_F`` of a factor K, eps of ``precision`` (the factor's dtype by default): the
    size of the rounding of a product with it, below which its eigenvalues, estimates and QR pivots
    are not resolved (the module docstring; the rank tolerance of numpy's matrix_rank, with the
    Frobenius norm to bound the products' rounding)."""
    eps = torch.finfo(precision or factor.dtype).eps
    return torch.linalg.matrix_norm(factor) * factor.shape[-1] * eps


def estimates(state: dict[str, Tensor], side: int) -> Tensor:
    """A factor's eigenvalues estimated in its basis, ``diag(Q^T K Q)``."""
    factor, basis = SIDES[side]
    q = state[basis]
    return (q * (state[factor] @ q)).sum(-2)


def kl_weights(
    state: dict[str, Tensor], side: int, dim: int, eps: float, like: Tensor, resolve: Resolve | None = None
) -> Tensor:
    """KL-Shampoo's weights of one side, ``1 / (dim * max(l, eps))`` with l = diag(Q^T K Q), its
    factor's eigenvalues estimated in its basis before this step's update; ``1 / dim`` on a side with
    no factor (the identity). With ``resolve`` (--soap-basis previous) l starts from the prior,
    ``lerp(l, prior, weight)``, and is clamped at the factor's :func:`resolution` too, so that
    unresolved directions weigh the same."""
    factor, _ = SIDES[side]
    if factor not in state:
        return like.new_full((dim,), 1.0 / dim)
    est = estimates(state, side)
    if resolve is None:
        return 1 / (dim * est.clamp_min(eps))
    est = torch.lerp(est, resolve.prior.unsqueeze(-1).expand_as(est), resolve.weight)
    return 1 / (dim * est.clamp_min(resolution(state[factor], resolve.precision).clamp_min(eps).unsqueeze(-1)))


def factor_terms(
    grad: Tensor, state: dict[str, Tensor], kl: bool, eps: float, resolve: Resolve | None = None
) -> dict[str, Tensor]:
    """This step's new term of each factor (step 1 of the module docstring), both computed before
    either factor moves: G G^T and G^T G, or KL-Shampoo's ``B diag(w_R) B^T`` with B = G Q_R and
    ``A^T diag(w_L) A`` with A = Q_L^T G (``resolve``: :func:`kl_weights`)."""
    rows, cols = grad.shape[-2:]
    terms = {}
    if "L" in state:
        if kl:
            b = grad @ state["Q_R"] if "Q_R" in state else grad
            terms["L"] = (b * kl_weights(state, 1, cols, eps, grad, resolve).unsqueeze(-2)) @ b.mT
        else:
            terms["L"] = grad @ grad.mT
    if "R" in state:
        if kl:
            a = state["Q_L"].mT @ grad if "Q_L" in state else grad
            terms["R"] = (a.mT * kl_weights(state, 0, rows, eps, grad, resolve).unsqueeze(-2)) @ a
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


def resolved_eigenbasis(factor: Tensor, precision: torch.dtype) -> Tensor:
    """The first refresh of --soap-basis previous: eigh, the eigenvectors of eigenvalues below the
    factor's :func:`resolution` completed (:func:`complete_`; per matrix of a stack)."""
    values, vectors = eigh_descending(factor)
    kept = values > resolution(factor, precision).unsqueeze(-1)
    if factor.dim() == 2:
        return complete_(vectors.contiguous(), kept)
    vectors = vectors.contiguous()
    for i in (~kept).any(-1).nonzero().flatten().tolist():
        complete_(vectors[i], kept[i])
    return vectors


def resolved_qr(power: Tensor, factor: Tensor, precision: torch.dtype) -> Tensor:
    """A later refresh of --soap-basis previous: QR of the power iteration ``K Q``; where a pivot
    ``|R_jj|`` is below the factor's :func:`resolution`, QR of the resolved columns alone, the rest
    completed (:func:`complete_`; per matrix of a stack, the rest of the stack's QR kept)."""
    q, r = qr(power)
    kept = r.diagonal(dim1=-2, dim2=-1).abs() > resolution(factor, precision).unsqueeze(-1)
    if bool(kept.all()):
        return q
    if power.dim() == 3:
        for i in (~kept).any(-1).nonzero().flatten().tolist():
            q[i] = resolved_qr(power[i], factor[i], precision)
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


def refresh_(state: dict[str, Tensor], first: bool, precision: torch.dtype | None = None) -> None:
    """Step 2 of the module docstring, in place: eigh of the factors at the first step; later, one QR
    power iteration of each basis, the first moment rotated from the old basis to the new one. With
    ``precision`` None (--soap-basis current) each basis is first sorted by its factor's estimated
    eigenvalues (the second moment permuted alike); else (previous) it is not, and what the gradient
    (of dtype ``precision``) cannot resolve is decided without rounding (the module docstring)."""
    if first:  # the moments are still zero: nothing to rotate or permute
        for factor, basis in SIDES:
            if factor in state:
                k = state[factor]
                state[basis].copy_(eigenvectors(k) if precision is None else resolved_eigenbasis(k, precision))
        return
    exp_avg = project_back(state["exp_avg"].to(state_dtype(state)), state)
    for side, (factor, basis) in enumerate(SIDES):
        if factor in state:
            q, k = state[basis], state[factor]
            power = k @ q
            if precision is not None:
                q.copy_(resolved_qr(power, k, precision))
                continue
            order = torch.argsort((q * power).sum(-2), dim=-1, descending=True, stable=True)
            state["exp_avg_sq"].copy_(permuted(state["exp_avg_sq"], order, side - 2))
            q.copy_(qr(permuted(power, order, -1))[0])
    state["exp_avg"].copy_(project(exp_avg, state))


def refreshes(step: int, frequency: int) -> bool:
    """Whether 1-based ``step`` refreshes the eigenbasis: steps 1, 1 + frequency, 1 + 2 frequency, ..."""
    return (step - 1) % frequency == 0


def adam_in_basis(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, count: int) -> Tensor:
    """Step 3 of the module docstring: Adam on the gradient projected into the current basis, its
    moments' ``count``-th update (bias correction), projected back. The rotations run in the bases'
    dtype, Adam in the moments' (fp32)."""
    projected = project(grad.to(state_dtype(state)), state).to(state["exp_avg"].dtype)
    state["exp_avg"].lerp_(projected, 1 - hyper.beta1)
    state["exp_avg_sq"].lerp_(projected.square(), 1 - hyper.beta2)
    m_hat = state["exp_avg"] / (1 - hyper.beta1**count)
    v_hat = state["exp_avg_sq"] / (1 - hyper.beta2**count)
    return project_back((m_hat / (v_hat.sqrt() + hyper.eps)).to(state_dtype(state)), state).to(grad.dtype)


def update_basis_(grad: Tensor, state: dict[str, Tensor], hyper: SoapStep, step: int, resolved: bool) -> None:
    """Steps 1 and 2 of the module docstring: the factors take ``grad``, then the basis is refreshed on
    refresh steps. ``resolved`` (--soap-basis previous): in the factors' dtype, resolved at the
    gradient's precision, KL-Shampoo's estimates starting from the gradient's RMS (:class:`Resolve`)."""
    s = hyper.settings
    resolve = None
    if resolved:
        rms = grad.square().mean((-2, -1)).sqrt().to(state_dtype(state))
        resolve = Resolve(grad.dtype, rms, s.soap_shampoo_beta ** (step - 1))
        grad = grad.to(state_dtype(state))
    beta = shampoo_beta(s.soap_shampoo_beta, step)
    for name, term in factor_terms(grad, state, s.soap_use_kl_shampoo, hyper.eps, resolve).items():
        state[name].lerp_(term, 1 - beta)
    if refreshes(step, s.soap_precondition_frequency):
        refresh_(state, first=step == 1, precision=resolve.precision if resolve else None)


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
    """Bytes held: both moments (2 m n fp32), and per preconditioned side its factor and basis (2 d^2 in
    :func:`factor_dtype`)."""
    settings = RULE.settings_in(context.config)
    m, n = (int(d) for d in shape[-2:])
    sides = sum(2 * d * d for d in (m, n) if d <= settings.soap_max_precond_dim)
    return 4 * 2 * m * n + factor_dtype(settings).itemsize * sides


def step_hyper(settings: SoapSettings, config) -> SoapStep:
    """What :func:`direction` reads (MatrixMath.hyper): the settings with --adam-beta1, --adam-beta2 and
    --adam-eps of the optimizer config."""
    return SoapStep(settings, config.adam_beta1, config.adam_beta2, config.adam_eps)


RULE = matrix_rule(
    NAME,
    # batched_on=(): stacked, SOAP measured no faster on CUDA (its per-matrix QR dominates; 64 of 512 x 1408:
    # 1.04x, 0.84x in the paper's order), and in Megatron-LM's order its first steps amplify the stacked products'
    # rounding into another update (benchmarks/results/batched_directions.md). The hook stays for the bench and
    # the tests.
    MatrixMath(init=init, direction=direction, hyper=step_hyper, batched=batched, batched_on=()),
    settings=SoapSettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer=NAME,
    elementwise="adamw",  # as Megatron-LM routes an emerging optimizer's non-matrix parameters to Adam
)
