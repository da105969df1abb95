"""The one place where megatron-core's CUDA assumptions are bent for CPU runs.

megatron-core creates some tensors with ``device='cuda'`` or
``torch.cuda.current_device()`` (grad scalers, pipeline p2p buffers, timers) and
calls ``torch.cuda.synchronize``/``current_stream`` and the CUDA RNG tracker's
``fork``. On a machine without CUDA, :func:`cuda_on_cpu` rewrites those device
arguments to the CPU and turns the stream calls and the fork into no-ops for the
duration of a block. With CUDA present it does
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


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Run megatron-core code that hard-codes CUDA on the CPU (no-op with CUDA)."""
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in ("current_device", "synchronize", "current_stream")}
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    # The CUDA RNG tracker (forked around dropout in sequence-parallel regions) has no
    # CPU states: there dropout draws from the CPU generator instead.
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved_fork = tracker.fork
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        tracker.fork = saved_fork
