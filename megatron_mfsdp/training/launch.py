"""CUDA_DEVICE_MAX_CONNECTIONS by the rule of the overlap this run uses, checked or set once at start-up.

CUDA gives each context this many hardware work queues (1 to 32, default 8). With 1, kernels from
every stream run in the order they were launched: megatron-core's tensor-parallel layers rely on
that, and an FSDP that overlaps its communication with compute is serialized by it. CUDA reads the
variable when the context is created, so pretrain calls this before initialize_distributed (its
torch.cuda.set_device creates the context).

The rule, from megatron-core 0.16.1 and Megatron-LM's validate_args (both at core_v0.16.1):

- --use-matrix-fsdp: not 1. MatrixFSDP prefetches the next units' weights from their owners
  (--mfsdp-prefetch-depth) and reduces gradients asynchronously (--overlap-grad-reduce, on by default
  on CUDA: training/setup.py overlap_grad_reduce) as NCCL operations on NCCL's own streams while
  compute runs; one queue puts them behind the compute kernels. Megatron-LM refuses 1 for
  Megatron-FSDP and torch FSDP2 ("FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than
  one", megatron/training/arguments.py); so do we. Unset stays unset (CUDA's 8).
- Otherwise, tensor or context parallelism on a GPU before Blackwell (compute capability < 10): 1.
  megatron-core's tensor_parallel/layers.py launches the sequence-parallel all-gather/reduce-scatter
  or the dgrad all-reduce asynchronously and then the weight-gradient GEMM (the fused accumulating
  one with --gradient-accumulation-fusion), relying on one queue to start the collective first; it
  warns otherwise and Megatron-LM raises. Unset: set to 1 here; another value: an error.
- Both (MatrixFSDP with TP, before Blackwell): FSDP's rule wins with a warning, as Megatron-LM does
  for Megatron-FSDP with TP ("they require different CUDA_MAX_CONNECTIONS settings").
- Anything else (Blackwell and later included): no requirement; the value is left as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
CUDA_DEFAULT = 8  # CUDA's default number of connections per context
VALID = range(1, 33)  # CUDA takes 1 to 32
BLACKWELL = 10  # compute capability major from which TP no longer needs 1 (Megatron-LM's arch check)


class LaunchError(RuntimeError):
    """A launch setting this run cannot work with; the message names the variable and the flags."""


@dataclass(frozen=True)
class Need:
    """What the run needs: ``"1"``, ``">1"`` (anything but 1) or None; why, and a warning if any."""

    value: str | None
    why: str
    flags: str
    warning: str = ""


def requirement(matrix_fsdp: bool, tp: int, cp: int = 1, arch_major: int | None = None) -> Need:
    """The rule above; ``arch_major`` None (no GPU here) answers for a GPU before Blackwell."""
    model_parallel = f"--tensor-model-parallel-size {tp}" + (f" --context-parallel-size {cp}" if cp > 1 else "")
    needs_one = (tp > 1 or cp > 1) and (arch_major is None or arch_major < BLACKWELL)
    if matrix_fsdp:
        warning = ""
        if needs_one:
            warning = (
                f"{model_parallel} with --use-matrix-fsdp: megatron-core's TP layers want 1 to start their "
                "asynchronous collectives before the weight-gradient GEMM, MatrixFSDP needs more than 1; "
                "FSDP's rule wins, so TP communication may overlap less (results are the same)"
            )
        why = (
            "MatrixFSDP overlaps its owner gathers (prefetch) and gradient reductions (--overlap-grad-reduce, on "
            "by default on CUDA) with compute on NCCL's streams, which one work queue would serialize"
        )
        return Need(">1", why, "--use-matrix-fsdp", warning)
    if needs_one:
        why = (
            "megatron-core's tensor-parallel layers rely on one work queue to start their asynchronous "
            "all-gather/reduce-scatter (--sequence-parallel) or dgrad all-reduce before the weight-gradient GEMM "
            "(the fused one with --gradient-accumulation-fusion), on GPUs before Blackwell"
        )
        return Need("1", why, f"{model_parallel} without --use-matrix-fsdp")
    return Need(None, "no MatrixFSDP and no tensor parallelism before Blackwell: no requirement", "")


def _check_value(current: str | None) -> None:
    if current is not None and not (current.strip().isdigit() and int(current) in VALID):
        raise LaunchError(f"{VARIABLE}={current!r}: CUDA takes an integer from 1 to 32 (default {CUDA_DEFAULT})")


def _conflict(need: Need, current: str | None) -> str | None:
    """The error text when ``current`` breaks ``need``; None when it does not."""
    if need.value == ">1" and current is not None and int(current) == 1:
        return (
            f"{VARIABLE}=1 with {need.flags}: {need.why}. Unset it (CUDA's default is {CUDA_DEFAULT}) or set it "
            "above 1 (Megatron-LM refuses 1 for Megatron-FSDP and torch FSDP2 alike)"
        )
    if need.value == "1" and current is not None and int(current) != 1:
        return (
            f"{VARIABLE}={current} with {need.flags}: {need.why}. Set {VARIABLE}=1 or leave it unset (then it "
            "is set to 1 at start-up), as Megatron-LM requires; or use --use-matrix-fsdp"
        )
    return None


def decide(need: Need, current: str | None, on_cuda: bool, cuda_started: bool = False) -> tuple[str | None, str]:
    """(the value to set, or None; the start-up line). Raises LaunchError on CUDA when the environment
    contradicts the rule, or when it must be set but CUDA already started in this process."""
    try:
        _check_value(current)
    except LaunchError as err:
        if on_cuda:
            raise
        return None, f"> {VARIABLE}: no effect on CPU; on CUDA this run would stop: {err}"
    conflict = _conflict(need, current)
    warning = f"; warning: {need.warning}" if need.warning else ""
    if not on_cuda:
        would = {"1": "need 1", ">1": "need it above 1"}.get(need.value, "leave it as it is")
        refused = f" (the value here, {current}, would be refused there)" if conflict else ""
        return None, f"> {VARIABLE}: no effect on CPU; on CUDA this run would {would}{refused}: {need.why}{warning}"
    if conflict:
        raise LaunchError(conflict)
    if need.value == "1" and current is None:
        if cuda_started:
            raise LaunchError(
                f"{VARIABLE} must be 1 with {need.flags} ({need.why}), but CUDA already started in this process, "
                f"where setting it has no effect: export {VARIABLE}=1 in the launch script"
            )
        return "1", f"> {VARIABLE}=1 (set: {need.flags}: {need.why}){warning}"
    shown = f" unset (CUDA's default, {CUDA_DEFAULT})" if current is None else f"={current} (from the environment)"
    return None, f"> {VARIABLE}{shown}: {need.why}{warning}"


def configure_cuda_connections(args, environ=None) -> str:
    """Check or set the variable for this run; returns the start-up line. Call before CUDA starts."""
    import torch

    environ = os.environ if environ is None else environ
    on_cuda = torch.cuda.is_available()  # counts devices; creates no context
    started = on_cuda and torch.cuda.is_initialized()
    tp, cp = args.tensor_model_parallel_size, getattr(args, "context_parallel_size", 1) or 1
    arch = torch.cuda.get_device_capability(0)[0] if on_cuda and (tp > 1 or cp > 1) else None
    need = requirement(bool(args.use_matrix_fsdp), tp, cp, arch)
    value, line = decide(need, environ.get(VARIABLE), on_cuda, started)
    if value is not None:
        environ[VARIABLE] = value
    return line
