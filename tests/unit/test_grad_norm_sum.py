"""The optimizer's sum of squares (grad norm, params norm): within fp32 rounding of the fp64 sum
without an fp64 copy. Each row's fp32 norm is rounded once (relative 6e-8 at most, its square
1.2e-7); the rows' squares are summed in fp64, so the total stays within 2 fp32 ulps."""

import pytest
import torch

from megatron_mfsdp.optim.optimizer import NORM_ROW, sum_of_squares

TOLERANCE = 2.4e-7  # relative: 2 fp32 ulps


@pytest.mark.parametrize("numel", [0, 7, NORM_ROW, 3 * NORM_ROW + 5, 1 << 22])
def test_sum_of_squares_matches_fp64(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 5
    ref = torch.linalg.vector_norm(x, dtype=torch.float64).square()
    got = sum_of_squares(x.view(-1, 1) if numel else x)
    assert got.dtype == torch.float64
    assert abs(got.item() - ref.item()) <= TOLERANCE * max(ref.item(), 1.0)


def test_one_fp32_norm_would_fail_that_tolerance():
    """Negative control: a single fp32 norm over 4M elements misses by far more (1.9e-4 measured)."""
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 5
    ref = torch.linalg.vector_norm(x, dtype=torch.float64).square().item()
    assert abs(torch.linalg.vector_norm(x).double().square().item() - ref) > 100 * TOLERANCE * ref


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_element_makes_it_non_finite(bad):
    x = torch.ones(3 * NORM_ROW + 5)
    for at in (5, 3 * NORM_ROW + 2):  # in a whole row and in the remainder
        y = x.clone()
        y[at] = bad
        assert not torch.isfinite(sum_of_squares(y))
