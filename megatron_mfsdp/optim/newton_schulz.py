"""Newton-Schulz orthogonalization: the kernels Muon and adaptive Muon run, and their planner cost.

``U S V^T -> ~U V^T`` by an odd matrix polynomial, with megatron-core's coefficient schedules
(--muon-coefficient-type). Three ways to compute the same polynomial: the standard iteration
(torch.optim.Muon's op order, bitwise equal to it), Gram space (fewer flops on a matrix with one side
> 1.5x the other) and, on a TP-split matrix, with the shards in place (a Gram all-reduce per
iteration). A stack of same-shape matrices runs batched. :class:`NewtonSchulz` is one configured run
(what the optimizer steps with), :class:`NewtonSchulzCost` what the planner charges for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

Coefficients = tuple[float, float, float]


@dataclass(frozen=True)
class NSSchedule:
    """A named Newton-Schulz coefficient schedule (a, b, c) for X <- a X + (b A + c A A) X, A = X X^T,
    and how it stretches to a step count: 'repeat' cycles the whole list (the step count must be a
    multiple of its length), 'extend' repeats the last tuple (at least ``len`` steps)."""

    steps: tuple[Coefficients, ...]
    stretch: str = "repeat"


# The names and numbers of megatron-core's --muon-coefficient-type (emerging_optimizers'
# orthogonalized_optimizers/muon_utils.py _COEFFICIENT_SETS, read for the published numbers).
NS_COEFFICIENTS: dict[str, NSSchedule] = {
    # Keller Jordan's constant quintic, the constants of torch.optim.Muon (DEFAULT_A/B/C).
    "simple": NSSchedule(((3.4445, -4.7750, 2.0315),)),
    # Per-step quintic optimized by Franz Cesista (leloykun.github.io/ponder/muon-opt-coeffs),
    # as in modded-nanogpt's train_gpt_medium.py.
    "quintic": NSSchedule(
        (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        )
    ),
    # Polar Express, Amsel, Persson, Musco, Gower, arXiv:2505.16932 (8 steps, last one repeated).
    "polar_express": NSSchedule(
        (
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        "extend",
    ),
    # Turbo-Muon's schedule (github.com/thib-s/flash-newton-schulz), without its preconditioning.
    "aol": NSSchedule(
        ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169))
    ),
    # Ours before megatron-core's names (--muon-coefficients quintic): the 5-step Polar Express
    # numbers published in modded-nanogpt's train_gpt.py (safety factor 2e-2), last one repeated.
    "polar_express_nanogpt": NSSchedule(
        (
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        "extend",
    ),
}

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NS_ALGORITHMS = ("auto", "standard", "gram")
"""--muon-ns-algorithm: standard iterates X (torch.optim.Muon's op order), gram iterates the small
Gram matrix (:func:`newton_schulz_gram`), auto takes gram in fp32 where it needs fewer flops.
Not in bf16 by default: there it measured up to 4.7x the standard iteration's error on random
matrices (2.5x with the "simple" schedule; equal on ill-conditioned ones)."""

GRAM_RESTART_EVERY = {torch.float64: 3, torch.float32: 3, torch.bfloat16: 2}
"""Gram-space iterations between restarts from X, by NS dtype. Without a restart, rounding grows
on ill-conditioned inputs (rank 4 + noise: 23-32x the standard iteration's error in fp32); every
3 in fp32 measured at the standard iteration's level. bf16 restarts every 2: at 3 a rounding-
negative eigenvalue of G (growing by p(lambda)^2 > 11 per update) diverged on some inputs."""

SYMMETRIC_BLOCKS = 4
"""Row blocks of a symmetric product (:func:`symmetric_product`): k blocks compute (k + 1) / 2k of
the multiply-adds (0.625 at 4; more blocks save little more and make smaller BLAS calls)."""

SYMMETRIC_MIN_ROWS = 256
"""Smallest short side that takes symmetric products: below it the block calls cost more than the
flops they save (and the tiny test models keep the plain products)."""


def ns_coefficients_for(name: str, steps: int) -> list[Coefficients]:
    """``steps`` (a, b, c) tuples of the named schedule, stretched as megatron-core does."""
    if name not in NS_COEFFICIENTS:
        valid = ", ".join(repr(k) for k in NS_COEFFICIENTS)
        raise ValueError(
            f"unknown Newton-Schulz coefficients {name!r} (--muon-coefficient-type); choose one of {valid}"
        )
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {steps}")
    schedule = NS_COEFFICIENTS[name]
    n = len(schedule.steps)
    if schedule.stretch == "extend":
        if steps < n and name == "polar_express":
            raise ValueError(f"--muon-num-ns-steps {steps}: --muon-coefficient-type polar_express needs at least {n}")
        return [schedule.steps[min(i, n - 1)] for i in range(steps)]
    if steps % n:
        raise ValueError(f"--muon-num-ns-steps {steps} must be a multiple of {n} for --muon-coefficient-type {name}")
    return [schedule.steps[i % n] for i in range(steps)]


def newton_schulz(
    grad: Tensor,
    steps: int = 5,
    coefficient_type: str = "simple",
    ns_dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    symmetric: bool = False,
) -> Tensor:
    """Approximately orthogonalize a 2D matrix (U S V^T -> ~U V^T); fp32 result.

    Op order follows ``torch.optim._muon._zeropower_via_newtonschulz`` so that with
    ``ns_dtype=bfloat16`` and the "jordan" schedule the result is bitwise equal:
    cast to ``ns_dtype``, transpose if rows > cols, divide by the Frobenius norm
    clamped at ``eps`` (computed in ``ns_dtype``), then iterate with ``addmm``.
    ``symmetric`` computes A and b A + c A A by :func:`symmetric_product` (the same dot
    products, 0.625 of their multiply-adds; not torch's calls, so bitwise equal only where BLAS
    sums a block row as it sums the whole product).
    """
    if grad.dim() != 2:
        raise ValueError(f"newton_schulz expects a 2D matrix, got shape {tuple(grad.shape)}")
    schedule = ns_coefficients_for(coefficient_type, steps)
    x, transposed = _wide_unit(grad, ns_dtype, eps)
    mm, addmm = _products(symmetric)
    for a, b, c in schedule:
        gram = mm(x, x.T)
        poly = addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        x = torch.addmm(x, poly, x, beta=a)  # a X + poly X
    return _restored(x, transposed)


def symmetric_product(
    left: Tensor, right: Tensor, bias: Tensor | None = None, beta: float = 1.0, alpha: float = 1.0
) -> Tensor:
    """``left @ right`` (or ``beta * bias + alpha * left @ right``) for a product known to be
    symmetric (X X^T, a polynomial times a polynomial of the same Gram matrix): the upper triangle
    by :data:`SYMMETRIC_BLOCKS` block rows, mirrored below. Each entry is the same dot product
    as in the whole product, for (k + 1) / 2k of its multiply-adds. Off the diagonal blocks the
    result is exactly symmetric; those blocks are as BLAS computes them, as in the whole product
    (making them symmetric too cost a quarter of the time saved). benchmarks/bench_ns_kernels.py
    measures the gain on a Newton-Schulz run."""
    m = left.shape[0]
    out = torch.empty(m, m, dtype=left.dtype, device=left.device)
    for s, e in _row_blocks(m):
        block = out[s:e, s:]  # written in place: BLAS takes the row stride, no copy of the block
        if bias is None:
            torch.mm(left[s:e], right[:, s:], out=block)
        else:
            torch.addmm(bias[s:e, s:], left[s:e], right[:, s:], beta=beta, alpha=alpha, out=block)
        out[e:, s:e] = block[:, e - s :].T
    return out


def _row_blocks(m: int) -> list[tuple[int, int]]:
    """[start, end) of the :data:`SYMMETRIC_BLOCKS` row blocks of an m x m symmetric product."""
    rows = -(-m // SYMMETRIC_BLOCKS)
    return [(s, min(m, s + rows)) for s in range(0, m, rows)]


def symmetric_multiply_adds(m: int, inner: int) -> int:
    """Multiply-adds of :func:`symmetric_product` of an (m, inner) by an (inner, m) matrix."""
    return sum((e - s) * (m - s) * inner for s, e in _row_blocks(m))


def _products(symmetric: bool):
    """(product, bias + product in torch.addmm's argument order) for the products a Newton-Schulz
    iteration knows to be symmetric: :func:`symmetric_product`'s, or torch's whole ones."""
    if not symmetric:
        return torch.matmul, _addmm
    return symmetric_product, lambda bias, m1, m2, beta, alpha: symmetric_product(m1, m2, bias, beta, alpha)


def _wide_unit(grad: Tensor, ns_dtype: torch.dtype, eps: float) -> tuple[Tensor, bool]:
    """The start every Newton-Schulz variant shares, in torch's op order: cast to ``ns_dtype``,
    transpose so that rows <= cols, divide by the Frobenius norm (per matrix of a stack) clamped
    at ``eps``. Frobenius >= spectral norm, so all singular values end up in [0, 1]."""
    x = grad.float().to(ns_dtype)
    transposed = grad.size(-2) > grad.size(-1)
    if transposed:
        x = x.mT
    norm = x.norm() if x.dim() == 2 else torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return x.div(norm.clamp(min=eps)), transposed


def _restored(x: Tensor, transposed: bool) -> Tensor:
    """Undo :func:`_wide_unit`'s transpose; a contiguous fp32 result."""
    return (x.mT if transposed else x).float().contiguous()


def _gram_segment(x: Tensor, coefficients: Sequence[Coefficients], symmetric: bool = False) -> Tensor:
    """``len(coefficients)`` Newton-Schulz iterations of a short-wide X (m <= n) in Gram space.

    Every iterate is X_k = Q_k X with Q_k a polynomial in G = X X^T, so Q_k, G_k = X_k X_k^T and
    P_k = a I + b G_k + c G_k^2 are m x m and commute: Q_{k+1} = P_k Q_k, G_{k+1} = P_k P_k G_k.
    Only the first product (G) and the last (Q X) touch n. Every other product is symmetric (of
    commuting symmetric matrices), so ``symmetric`` computes each by :func:`symmetric_product`."""
    mm, addmm = _products(symmetric)
    gram = mm(x, x.mT)
    q = None
    for i, (a, b, c) in enumerate(coefficients):
        poly = addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G G
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        q = poly if q is None else mm(poly, q)
        if i + 1 < len(coefficients):
            gram = mm(poly, mm(poly, gram))
    return q @ x


def _addmm(bias: Tensor, m1: Tensor, m2: Tensor, beta: float, alpha: float) -> Tensor:
    return (torch.addmm if bias.dim() == 2 else torch.baddbmm)(bias, m1, m2, beta=beta, alpha=alpha)


def newton_schulz_gram(
    grad: Tensor,
    steps: int = 5,
    coefficient_type: str = "simple",
    ns_dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    symmetric: bool = False,
) -> Tensor:
    """:func:`newton_schulz`'s polynomial iteration computed in Gram space (see
    :func:`_gram_segment`), restarted from X every :data:`GRAM_RESTART_EVERY` iterations; a
    (rows, cols) matrix or a (batch, rows, cols) stack; fp32 result.

    Per segment of L iterations it costs 2 products of m x m x n and 4L - 3 of m x m x m (m the
    smaller side) against L x (2 m^2 n + m^3) x 2 flops for the standard one: fewer flops once
    n > 1.5 m at 5 steps. The same math, not the same rounding: in fp32 its deviation from an fp64 run is
    0.5-1.7x the standard iteration's (every coefficient schedule, random and ill-conditioned
    inputs); in bf16 up to 4.7x on random inputs, equal on ill-conditioned ones (see
    :data:`NS_ALGORITHMS`; tests/unit/test_muon_gram.py states the tolerances). ``symmetric``
    (2D only) takes every product but Q X by :func:`symmetric_product`."""
    if grad.dim() not in (2, 3):
        raise ValueError(f"newton_schulz_gram expects a matrix or a stack, got shape {tuple(grad.shape)}")
    schedule = ns_coefficients_for(coefficient_type, steps)
    x, transposed = _wide_unit(grad, ns_dtype, eps)
    every = GRAM_RESTART_EVERY[ns_dtype]
    if symmetric and x.dim() != 2:
        raise ValueError(f"symmetric products take one matrix, got a stack of shape {tuple(grad.shape)}")
    for start in range(0, len(schedule), every):
        x = _gram_segment(x, schedule[start : start + every], symmetric)
    return _restored(x, transposed)


def ns_multiply_adds(
    shape: Sequence[int], steps: int, ns_dtype: torch.dtype, gram: bool, symmetric: bool = False
) -> int:
    """Multiply-adds of ``steps`` Newton-Schulz iterations of one (rows, cols) matrix, counted as in
    :func:`newton_schulz_gram`'s docstring: per iteration 2 m^2 n + m^3 for the standard one;
    ``symmetric`` counts the symmetric products as :func:`symmetric_product` runs them."""
    m, n = sorted(int(d) for d in shape[-2:])
    sym_n, sym_m = (symmetric_multiply_adds(m, n), symmetric_multiply_adds(m, m)) if symmetric else (m * m * n, m**3)
    if not gram:
        return steps * (sym_n + sym_m + m * m * n)
    segments = -(-steps // GRAM_RESTART_EVERY[ns_dtype])
    return segments * (sym_n + m * m * n) + (4 * steps - 3 * segments) * sym_m


def gram_pays(shape: Sequence[int], steps: int, ns_dtype: torch.dtype = torch.float32) -> bool:
    """Whether :func:`newton_schulz_gram` needs fewer flops than :func:`newton_schulz` on a
    (rows, cols) matrix."""
    return ns_multiply_adds(shape, steps, ns_dtype, gram=True) < ns_multiply_adds(shape, steps, ns_dtype, gram=False)


def auto_may_use_gram(ns_dtype: torch.dtype) -> bool:
    """Whether --muon-ns-algorithm auto uses gram (where it pays) in this dtype: fp32 only (see
    :data:`NS_ALGORITHMS` for why not bf16)."""
    return ns_dtype == torch.float32


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"unknown --muon-ns-algorithm {algorithm!r}; choose one of {', '.join(NS_ALGORITHMS)}")


def uses_gram(shape: Sequence[int], steps: int, ns_dtype: torch.dtype, algorithm: str) -> bool:
    """Whether :func:`orthogonalize` runs the Gram-space iteration on a matrix of ``shape``."""
    _check_algorithm(algorithm)
    return algorithm == "gram" or (algorithm == "auto" and auto_may_use_gram(ns_dtype) and gram_pays(shape, steps))


def uses_symmetric(shape: Sequence[int], algorithm: str, on_cpu: bool) -> bool:
    """Whether :func:`orthogonalize` computes the symmetric products by :func:`symmetric_product`:
    under auto and gram, for one matrix on a CPU (where a product's time follows its flops; a GPU
    runs stacks, and many small calls would cost launches) whose short side is at least
    :data:`SYMMETRIC_MIN_ROWS`. ``standard`` keeps torch.optim.Muon's calls."""
    _check_algorithm(algorithm)
    return algorithm != "standard" and on_cpu and len(shape) == 2 and min(shape) >= SYMMETRIC_MIN_ROWS


def orthogonalize(
    grad: Tensor, steps: int, coefficient_type: str, ns_dtype: torch.dtype, algorithm: str = "standard"
) -> Tensor:
    """Newton-Schulz of a matrix (or a same-shape stack) by ``algorithm`` (:data:`NS_ALGORITHMS`)."""
    symmetric = uses_symmetric(grad.shape, algorithm, grad.device.type == "cpu")
    if uses_gram(grad.shape, steps, ns_dtype, algorithm):
        return newton_schulz_gram(grad, steps, coefficient_type, ns_dtype, symmetric=symmetric)
    if grad.dim() == 3:
        return newton_schulz_batched(grad, steps, coefficient_type, ns_dtype)
    return newton_schulz(grad, steps, coefficient_type, ns_dtype, symmetric=symmetric)


def newton_schulz_batched(
    grads: Tensor,
    steps: int = 5,
    coefficient_type: str = "simple",
    ns_dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> Tensor:
    """:func:`newton_schulz` of a stack (B, rows, cols) of same-shape matrices, with batched
    products (``baddbmm``) and per-matrix norms in the same op order. Equal to the per-matrix
    results within fp32 rounding, not bitwise: BLAS may block a batched product differently
    (by machine and thread count; tests/unit/test_batched_directions.py states the tolerance)."""
    if grads.dim() != 3:
        raise ValueError(f"newton_schulz_batched expects a (batch, rows, cols) stack, got {tuple(grads.shape)}")
    schedule = ns_coefficients_for(coefficient_type, steps)
    x, transposed = _wide_unit(grads, ns_dtype, eps)
    for a, b, c in schedule:
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return _restored(x, transposed)


@dataclass(frozen=True)
class NewtonSchulzCost:
    """The Newton-Schulz run the planner costs each Muon matrix by: the optimizer config's steps,
    dtype and algorithm (the kernel :func:`orthogonalize` will pick, gram or standard, per shape)
    and where it runs (``on_cpu``: symmetric products, :func:`uses_symmetric`)."""

    steps: int = 5
    dtype: str = "bf16"  # a key of NS_DTYPES
    algorithm: str = "auto"
    on_cpu: bool = False  # the optimizer steps on a CPU (GPU clusters are what plans are for)

    def __post_init__(self):
        if self.dtype not in NS_DTYPES:
            raise ValueError(f"unknown Newton-Schulz dtype {self.dtype!r} (--muon-ns-dtype); choose one of bf16, fp32")
        _check_algorithm(self.algorithm)

    def multiply_adds(self, shape: Sequence[int]) -> int:
        dtype = NS_DTYPES[self.dtype]
        gram = uses_gram(shape, self.steps, dtype, self.algorithm)
        return ns_multiply_adds(shape, self.steps, dtype, gram, uses_symmetric(shape, self.algorithm, self.on_cpu))


def newton_schulz_cost(
    shape: Sequence[int], split_rows: Sequence[int] | None = None, ns: NewtonSchulzCost = NewtonSchulzCost()
) -> int:
    """Multiply-adds of orthogonalizing one matrix as ``ns`` says (every iteration, the m^3 terms
    included), summed over the blocks orthogonalized separately."""
    return sum(ns.multiply_adds(block) for block in orthogonalized_blocks(shape, split_rows))


def orthogonalized_blocks(shape: Sequence[int], split_rows: Sequence[int] | None) -> list[tuple[int, int]]:
    """(rows, cols) of each block Muon orthogonalizes apart: the whole matrix, or with ``split_rows``
    (rows per query group of Q, K, V) one block each of groups x rows."""
    rows, cols = shape
    if not split_rows:
        return [(rows, cols)]
    groups = rows // sum(split_rows)
    return [(groups * r, cols) for r in split_rows]


def distributed_newton_schulz(
    x_local: Tensor, split_dim: int, group, steps: int, coefficient_type: str, ns_dtype: torch.dtype, eps: float = 1e-7
) -> Tensor:
    """Newton-Schulz of the matrix whose shards along ``split_dim`` are spread over the TP ``group``, the
    shards left in place; returns this rank's shard of the result (fp32). ``p(X X^T) X = X p(X^T X)``, so
    with rows split (column-parallel) each rank updates ``X_i <- a X_i + X_i (b G + c G^2)`` with
    ``G = sum_i X_i^T X_i``, and with columns split (row-parallel) ``X_i <- a X_i + (b G + c G^2) X_i``
    with ``G = sum_i X_i X_i^T``: one all-reduce of the Gram matrix per iteration (the first also gives
    the Frobenius norm, its trace). Always the standard iteration: its all-reduced quantity is the Gram
    matrix of the sharded X, which a Gram-space iteration would need only once."""
    x = x_local.float().to(ns_dtype)

    def gram(m: Tensor) -> Tensor:
        g = (m.T @ m if split_dim == 0 else m @ m.T).float()
        dist.all_reduce(g, group=group)
        return g.to(ns_dtype)

    g = gram(x)
    norm = g.float().diagonal().sum().clamp(min=0).sqrt().clamp(min=eps)
    x = x / norm.to(ns_dtype)
    g = g / (norm * norm).to(ns_dtype)
    for step, (a, b, c) in enumerate(ns_coefficients_for(coefficient_type, steps)):
        if step:
            g = gram(x)
        poly = torch.addmm(g, g, g, beta=b, alpha=c)
        x = torch.addmm(x, x, poly, beta=a) if split_dim == 0 else torch.addmm(x, poly, x, beta=a)
    return x.float().contiguous()


@dataclass(frozen=True)
class NewtonSchulz:
    """One configured run: ``steps`` iterations of the named coefficient schedule in ``dtype`` by
    ``algorithm`` (:data:`NS_ALGORITHMS`); what Muon and adaptive Muon orthogonalize with."""

    steps: int = 5
    coefficient_type: str = "quintic"
    dtype: torch.dtype = torch.bfloat16
    algorithm: str = "auto"

    def __post_init__(self):
        ns_coefficients_for(self.coefficient_type, self.steps)  # names the flag that is wrong
        _check_algorithm(self.algorithm)

    def __call__(self, x: Tensor) -> Tensor:
        """:func:`orthogonalize` of a matrix or a same-shape stack."""
        return orthogonalize(x, self.steps, self.coefficient_type, self.dtype, self.algorithm)

    def sharded(self, x_local: Tensor, split_dim: int, group) -> Tensor:
        """:func:`distributed_newton_schulz` of the matrix this rank holds the shard ``x_local`` of."""
        return distributed_newton_schulz(x_local, split_dim, group, self.steps, self.coefficient_type, self.dtype)

    def cost(self, on_cpu: bool = False) -> NewtonSchulzCost:
        """What the planner charges for this run on a CPU or a GPU."""
        dtype = next(k for k, v in NS_DTYPES.items() if v == self.dtype)
        return NewtonSchulzCost(self.steps, dtype, self.algorithm, on_cpu)
