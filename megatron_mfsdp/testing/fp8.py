"""The FP8 negative control the tests and benchmarks share: FP8-only storage, no fp32 master."""

from __future__ import annotations

import torch

from ..precision import dequantize


@torch.no_grad()
def drop_fp8_masters(optimizer) -> None:
    """Replace every owned FP8 matrix's fp32 master by its dequantized FP8 weight, as if the weight
    were stored in FP8 alone: call after each ``optimizer.step()``. Updates smaller than the FP8
    rounding are then lost, which the fp32 master keeps (the quality benchmark measures the drift)."""
    for _, master, weight in optimizer.fp8_matrices():
        master.copy_(dequantize(weight, torch.float32))
