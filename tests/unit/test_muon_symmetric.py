"""Symmetric products in Newton-Schulz (optim/newton_schulz.py symmetric_product): X X^T and the
polynomials of the Gram matrix computed by block rows and mirrored, what auto and gram run on a
CPU. Checked against the whole products, an fp64 run, and torch's own flop count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_mfsdp.optim import newton_schulz as ns

# (short side, long side): one divisible by the 4 row blocks, one not (blocks of 75 rows).
SHAPES = [(256, 640), (640, 256), (300, 300)]
DTYPES = [torch.float32, torch.bfloat16]
# Largest (symmetric error) / (plain error), each the relative Frobenius distance to an fp64 run.
# Measured 0.99-1.01 for the standard iteration (bitwise 1.00 in bf16 here) and 0.99-1.25 for
# gram (the worst on squares, which auto leaves to the standard iteration), random and rank-4 inputs.
ERROR_RATIO = 1.35


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [256, 300])
def test_symmetric_product_is_the_whole_product_mirrored(dtype, rows):
    """X X^T and b A + c A A by block rows: exactly symmetric off the diagonal blocks, equal to the
    whole product within one rounding of the dtype (each entry is the same dot product; bitwise
    where BLAS sums a block row as it sums the whole product: bf16 on the development CPU)."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 3 * rows, generator=gen) / (3 * rows) ** 0.5).to(dtype)  # unit diagonal
    block = torch.arange(rows) // -(-rows // ns.SYMMETRIC_BLOCKS)
    mirrored = block[:, None] != block[None, :]
    gram = ns.symmetric_product(x, x.T)
    assert torch.equal(gram[mirrored], gram.T[mirrored])
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(gram, x @ x.T, rtol=tol, atol=tol)
    poly = ns.symmetric_product(gram, gram, gram, beta=-4.775, alpha=2.0315)
    assert torch.equal(poly[mirrored], poly.T[mirrored])
    torch.testing.assert_close(poly, torch.addmm(gram, gram, gram, beta=-4.775, alpha=2.0315), rtol=tol, atol=tol)
    # Control: the mirror is only right for a symmetric product; X times another matrix is not.
    other = torch.randn(3 * rows, rows, generator=gen).to(dtype)
    assert _error(ns.symmetric_product(x, other), (x @ other).double()) > 0.5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gram", [False, True])
def test_symmetric_kernels_match_the_plain_ones_and_their_flop_count(shape, dtype, gram):
    """Same polynomial, the plain kernel's accuracy against fp64 (within ERROR_RATIO), and
    ns_multiply_adds(symmetric=True) is what torch counts them doing: 0.6-0.8 of the plain count."""
    kernel = ns.newton_schulz_gram if gram else ns.newton_schulz
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    with FlopCounterMode(display=False) as counter:
        fast = kernel(g, 5, "simple", dtype, symmetric=True)
    assert counter.get_total_flops() == 2 * ns.ns_multiply_adds(shape, 5, dtype, gram, symmetric=True)
    plain_count = ns.ns_multiply_adds(shape, 5, dtype, gram)
    assert 0.6 * plain_count < ns.ns_multiply_adds(shape, 5, dtype, gram, symmetric=True) < 0.8 * plain_count
    ref = ns.newton_schulz(g.double(), 5, "simple", torch.float64)
    plain = kernel(g, 5, "simple", dtype)
    assert _error(fast, ref) <= ERROR_RATIO * _error(plain, ref), (_error(fast, ref), _error(plain, ref))


def test_auto_and_gram_take_symmetric_products_on_cpu_and_standard_keeps_torchs_calls():
    big, small = torch.randn(640, 256), torch.randn(128, 32)
    for dtype, gram in ((torch.float32, True), (torch.bfloat16, False)):
        kernel = ns.newton_schulz_gram if gram else ns.newton_schulz
        picked = ns.orthogonalize(big, 5, "quintic", dtype, "auto")
        assert torch.equal(picked, kernel(big, 5, "quintic", dtype, symmetric=True))
    forced = ns.orthogonalize(big, 5, "quintic", torch.bfloat16, "gram")
    assert torch.equal(forced, ns.newton_schulz_gram(big, 5, "quintic", torch.bfloat16, symmetric=True))
    standard = ns.orthogonalize(big, 5, "quintic", torch.float32, "standard")
    assert torch.equal(standard, ns.newton_schulz(big, 5, "quintic", torch.float32))
    # Control: the symmetric fp32 run is not the plain one bitwise, so the equalities above tell them apart.
    assert not torch.equal(standard, ns.newton_schulz(big, 5, "quintic", torch.float32, symmetric=True))
    # Below SYMMETRIC_MIN_ROWS, and for stacks or off a CPU, the plain products.
    assert not ns.uses_symmetric(small.shape, "auto", on_cpu=True)
    assert not ns.uses_symmetric((2, 640, 256), "auto", on_cpu=True)
    assert not ns.uses_symmetric(big.shape, "auto", on_cpu=False)
    with pytest.raises(ValueError, match="stack"):
        ns.newton_schulz_gram(torch.randn(2, 8, 16), 5, "simple", torch.float32, symmetric=True)


def test_planner_cost_counts_symmetric_products_where_the_optimizer_runs_them():
    shape = (640, 256)
    on_cpu, on_gpu = (ns.NewtonSchulzCost(5, "fp32", "auto", on_cpu=flag) for flag in (True, False))
    assert on_cpu.multiply_adds(shape) == ns.ns_multiply_adds(shape, 5, torch.float32, True, symmetric=True)
    assert on_gpu.multiply_adds(shape) == ns.ns_multiply_adds(shape, 5, torch.float32, True)
    standard = ns.NewtonSchulzCost(5, "fp32", "standard", on_cpu=True)
    assert standard.multiply_adds(shape) == ns.ns_multiply_adds(shape, 5, torch.float32, False)
