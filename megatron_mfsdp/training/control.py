"""Run control: every rank launched with the same flags, when to stop (--exit-interval,
--exit-duration-in-mins, --exit-signal-handler on --exit-signal), --profile (nsys or PyTorch profiler)
and manual GC."""

from __future__ import annotations

import gc
import hashlib
import json
import signal
import time

import torch
import torch.distributed as dist

# Flags that may differ between ranks of one job.
PER_RANK = {"rank", "local_rank", "explicit", "notices", "deprecations"}


def _comparable(args) -> dict:
    out = {}
    for key, value in sorted(vars(args).items()):
        if key in PER_RANK:
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        out[key] = value
    return out


def check_ranks_agree(args) -> None:
    """All-gather a digest of the parsed flags; a rank launched with different flags raises on
    every rank within seconds, naming the flags that differ (instead of hanging later)."""
    mine = _comparable(args)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differing = sorted(k for k in set().union(*everyone) if len({json.dumps(e.get(k)) for e in everyone}) > 1)
    detail = "; ".join(
        f"--{k.replace('_', '-')}: " + ", ".join(f"rank {r}={e.get(k)!r}" for r, e in enumerate(everyone))
        for k in differing[:8]
    )
    raise RuntimeError(f"ranks were launched with different flags: {detail}")


class ExitControl:
    """Megatron-LM's exit conditions, decided the same way on every rank."""

    def __init__(self, args, start_time: float):
        self.args, self.start = args, start_time
        self.signal_received = False
        if args.exit_signal_handler:  # --exit-signal: a signal's name (arguments/types.py signal_name)
            signal.signal(getattr(signal, getattr(args, "exit_signal", "SIGTERM")), self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = True

    def reason(self, iteration: int, device) -> str | None:
        """Megatron-LM's exit message after this iteration (the caller saves first when --save
        is set), or None; checked in its order: signal, duration, iteration (training.py
        checkpoint_and_decide_exit at core_v0.16.1)."""
        args = self.args
        flags = torch.tensor([0.0, 0.0], device=device)
        if args.exit_signal_handler:
            flags[0] = float(self.signal_received)
        train_time = (time.time() - self.start) / 60.0
        if args.exit_duration_in_mins:
            flags[1] = float(train_time > args.exit_duration_in_mins)
        if args.exit_signal_handler or args.exit_duration_in_mins:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return "exiting program after receiving SIGTERM."
        if flags[1]:
            return f"exiting program after {train_time} minutes"
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"exiting program at iteration {iteration}"
        return None


class Profiler:
    """--profile as Megatron-LM's train() runs it (megatron/training/training.py at core_v0.16.1:
    train and post_training_step_callbacks), on --profile-ranks only.

    nsys mode (default): cudaProfilerStart and emit_nvtx(record_shapes=True) at the top of the
    loop once --profile-step-start iterations are done, cudaProfilerStop after iteration
    --profile-step-end: iterations start+1..end, for `nsys profile --capture-range=cudaProfilerApi`.
    Without CUDA nothing is captured (validation printed a notice).
    --use-pytorch-profiler: torch.profiler with Megatron-LM's schedule, stepped at the top of each
    iteration (wait start-1, warmup 1, active end-start: iterations start..end-1 when start > 0);
    tensorboard_trace_handler writes a chrome trace (<host>_<pid>.<ns>.pt.trace.json) into
    --tensorboard-dir, else --output-dir (validation requires one)."""

    def __init__(self, args):
        self.args, self.prof, self.nvtx = args, None, None
        on = args.profile and dist.get_rank() in args.profile_ranks
        self.nsys = on and not args.use_pytorch_profiler and torch.cuda.is_available()
        if on and args.use_pytorch_profiler:
            self.folder = args.tensorboard_dir or args.output_dir
            start, end = args.profile_step_start, args.profile_step_end
            self.prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
                ),
                on_trace_ready=self._written(torch.profiler.tensorboard_trace_handler(self.folder)),
                record_shapes=True,
                with_stack=True,
            )
            self.prof.start()

    def _written(self, handler):
        def on_trace_ready(prof) -> None:
            handler(prof)
            print(f"> profiler: PyTorch trace (*.pt.trace.json, chrome format) written to {self.folder}", flush=True)

        return on_trace_ready

    def step(self, iteration: int) -> None:
        """At the top of the loop, `iteration` iterations done (Megatron-LM's train loop)."""
        if iteration >= self.args.profile_step_end:
            self.stop()  # a no-op once the loop calls after_step(end); until then the stop lands here
        elif self.prof is not None:
            self.prof.step()
        elif self.nsys and iteration == self.args.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """After iteration `iteration` (Megatron-LM's post_training_step_callbacks)."""
        if iteration == self.args.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Ends whichever capture is open (also when training ends before --profile-step-end)."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.nvtx is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None


def manual_gc_start(args) -> None:
    if args.manual_gc:
        gc.disable()
        gc.collect()


def manual_gc_eval(args, generation: int = 2) -> None:
    """--manual-gc: a collection before each evaluation and one of generation 0 after it, unless
    --no-manual-gc-eval (Megatron-LM's train loop, megatron/training/training.py at HEAD)."""
    if args.manual_gc and args.manual_gc_eval:
        gc.collect(generation)


def manual_gc_step(args, iteration: int) -> None:
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()
