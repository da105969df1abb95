"""The one place where megatron-core's CUDA assumptions are bent for CPU runs.

megatron-core creates some tensors with ``device='cuda'`` or
``torch.cuda.current_device()`` (grad scalers, pipeline p2p buffers, timers) and
calls ``torch.cuda.synchronize``/``current_stream`` and the CUDA RNG tracker's
``fork``, its MoE all-to-all dispatcher creates a CUDA stream and event and copies its split
sizes to the host on it and gathers tensors of uneven sizes (which NCCL takes and gloo does not), and
its optimizers compare ``tensor.type()`` with CUDA type names. On a
machine without CUDA, :func:`cuda_on_cpu` rewrites those device arguments to the CPU,
reports CPU tensor types under their CUDA names, turns the stream, event and fork calls
into no-ops, hands the split sizes over as host arrays and pads uneven gathers, for the duration of a
block (the
run's model construction, forward-backward and optimizer step all run inside one). With CUDA
present it does nothing, so GPU runs use megatron-core unchanged.
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


class _NullEvent:
    """A CUDA event on the host: everything it would wait for has already happened."""

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _NullStream:
    """A CUDA stream on the host: work runs in program order, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's maybe_move_tensor_to_cpu (transformer/moe/moe_utils.py) for host tensors: on CUDA
    it copies a device tensor to the host, as a numpy array with ``as_numpy``; a host tensor it returns
    as it is. The all-to-all dispatcher hands those arrays to all_to_all_single as split sizes, which
    gloo refuses as tensors (TypeError) and accepts as arrays: so a host tensor asked for as numpy
    becomes one here too, as a device tensor would."""
    if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
        return tensor.numpy()
    return tensor


def _uneven_all_gather(all_gather):
    """torch.distributed.all_gather for gloo, which refuses tensors of different sizes ("invalid tensor
    size") where NCCL takes them: megatron-core's MoE all-to-all dispatcher gathers each tensor-parallel
    rank's tokens for its local experts, a different count per rank (tensor_parallel/mappings.py
    _gather_along_first_dim with output_split_sizes). Uneven first dimensions travel padded to the
    largest and are cut back; even ones go to gloo as they are."""

    def gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list) or async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = [t.shape[0] for t in tensor_list]
        padded = tensor.new_zeros((max(rows), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        received = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(received, padded, group=group)
        for out, got, n in zip(tensor_list, received, rows):
            out.copy_(got[:n])
        return None

    return gather


def _patches():
    """(object, attribute, CPU stand-in) of everything cuda_on_cpu swaps for the block."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, random
    from megatron.core.transformer.moe import token_dispatcher

    no_state = torch.empty(0, dtype=torch.uint8)
    return [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "current_stream", lambda *a, **k: _NullStream()),
        # The MoE all-to-all dispatcher copies its split sizes to the host on a side stream and waits
        # for them through an event (token_dispatcher.py _maybe_dtoh_and_synchronize at core_v0.16.1).
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "Event", _NullEvent),
        (torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext()),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        (torch.distributed, "all_gather", _uneven_all_gather(torch.distributed.all_gather)),
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


BF16_UNITS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of a bf16 matrix unit, strongest first: with one, bf16 products beat fp32;
without either, bf16 is emulated and far slower than fp32 (benchmarks/results/cpu_costs.md)."""


def cpu_flags() -> frozenset[str] | None:
    """The ``flags`` line of /proc/cpuinfo (x86 Linux); None where there is none (other
    systems, ARM's ``Features``)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else frozenset(line.partition(":")[2].split())


def bf16_matmul_choice() -> tuple[bool, str]:
    """(whether this CPU has a bf16 matrix unit, why), from the flags alone (:data:`BF16_UNITS`).
    No timing: two launches, and every rank of a machine type, decide alike, so the numerics of a
    run do not depend on how loaded the machine was at start-up. No flags: fp32, which any CPU
    runs."""
    flags = cpu_flags()
    if flags is None:
        return False, "no /proc/cpuinfo flags to show a bf16 matrix unit"
    unit = next((unit for unit in BF16_UNITS if unit in flags), None)
    if unit is None:
        return False, "no bf16 matrix unit (neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo flags)"
    return True, f"{unit} in /proc/cpuinfo flags"


def fast_bf16_matmul() -> bool:
    """Whether this CPU has a bf16 matrix unit (:func:`bf16_matmul_choice`)."""
    return bf16_matmul_choice()[0]
