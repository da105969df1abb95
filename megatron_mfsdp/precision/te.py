"""Transformer Engine's own FP8 tensor from the bytes and scales the owner made, on a GPU.

Untested here: this machine has neither CUDA nor Transformer Engine, so ``te_available()``
is False and the wrapper dequantizes instead (``fp8.dequantize``). The constructor follows
transformer_engine/pytorch/tensor/float8_tensor.py (TE 2.x, read, not copied): a
``Float8Tensor`` holds ``_data`` (uint8 e4m3 bytes) and ``_scale_inv`` (fp32, shape (1,)),
which is exactly what ``fp8.Fp8Weight`` carries for the per-tensor recipes, so no value is
re-quantized. Blockwise weights would need ``Float8BlockwiseQTensor`` with TE's padded
scale layout; until that is written and checked on a GPU they are dequantized.
"""

from __future__ import annotations

import importlib.util

import torch

from .fp8 import Fp8Weight, dequantize


def te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def te_float8_weight(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A TE Float8Tensor viewing our payload and scale-inverse (per-tensor recipes); the
    dequantized weight otherwise (blockwise, or no TE)."""
    if weight.recipe == "blockwise" or not te_available() or not weight.data.is_cuda:
        return dequantize(weight, dtype)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    return Float8Tensor(
        shape=weight.data.shape,
        dtype=dtype,
        data=weight.data,
        fp8_scale_inv=weight.scale_inv,
        fp8_dtype=tex.DType.kFloat8E4M3,
        requires_grad=False,
    )
