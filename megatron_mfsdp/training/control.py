"""Run control: every rank launched with the same flags, when to stop (--exit-interval,
--exit-duration-in-mins, --exit-signal-handler), the PyTorch profiler and manual GC."""

from __future__ import annotations

import gc
import hashlib
import json
import os
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
        if args.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

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
    """--profile: the PyTorch profiler over iterations [--profile-step-start, --profile-step-end)
    on --profile-ranks; the trace goes to --tensorboard-dir (or --output-dir)."""

    def __init__(self, args):
        self.args, self.prof = args, None
        self.on = args.profile and dist.get_rank() in args.profile_ranks
        self.folder = args.tensorboard_dir or args.output_dir or "."

    def step(self, iteration: int) -> None:
        if not self.on:
            return
        if iteration == self.args.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
        elif iteration == self.args.profile_step_end and self.prof is not None:
            self.stop()

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"profile_rank{dist.get_rank()}.json")
        self.prof.export_chrome_trace(path)
        self.prof = None
        print(f"> profiler trace written to {path}", flush=True)


def manual_gc_start(args) -> None:
    if args.manual_gc:
        gc.disable()
        gc.collect()


def manual_gc_step(args, iteration: int) -> None:
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()
