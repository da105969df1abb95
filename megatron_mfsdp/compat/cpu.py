"""The one place where megatron-core's CUDA assumptions are bent for CPU runs.

megatron-core creates some tensors with ``device='cuda'`` or
``torch.cuda.current_device()`` (grad scalers, pipeline p2p buffers, timers) and
calls ``torch.cuda.synchronize``/``current_stream`` and the CUDA RNG tracker's
``fork``, and its optimizers compare ``tensor.type()`` with CUDA type names. On a
machine without CUDA, :func:`cuda_on_cpu` rewrites those device arguments to the CPU,
reports CPU tensor types under their CUDA names and turns the stream calls and the fork
into no-ops for the duration of a block. With CUDA present it does
nothing, so GPU runs use megatron-core unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrite ``device=cuda`` keyword arguments to the CPU and make
    ``Tensor.cuda()`` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers check param.type() == 'torch.cuda.FloatTensor' (and Half, BFloat16)
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return None


def _patches():
    """(object, attribute, CPU stand-in) of everything cuda_on_cpu swaps for the block."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, random

    no_state = torch.empty(0, dtype=torch.uint8)
    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_stream", lambda *a, **k: _NullStream()),
        # The CUDA RNG tracker (forked around dropout in sequence-parallel regions) has no CPU
        # states: there dropout draws from the CPU generator, which activation recomputation
        # saves and restores itself; the CUDA part of its saved state is empty.
        (get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext()),
        (random, "_get_cuda_rng_state", lambda *a, **k: no_state),
        (random, "_set_cuda_rng_state", lambda *a, **k: None),
    ]


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Run megatron-core code that hard-codes CUDA on the CPU (no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    patches = _patches()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, stand_in in patches:
        setattr(obj, name, stand_in)
    try:
        with _CudaToCpu():
            yield
    finally:
        for obj, name, original in saved:
            setattr(obj, name, original)


def fast_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX-BF16 or AVX512-BF16 in
    /proc/cpuinfo). There a bf16 product is several times faster than fp32 (measured 0.84 vs
    7.05 ms for 512x512 @ 512x2048 with AMX); elsewhere bf16 falls back to a slow emulation. A
    fixed rule, not a timing, so every rank of a job on the same machine type agrees."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
