"""--log-progress: Megatron-LM's progress.txt in --save, one tab-separated line per event (rank 0):

    2026-08-22 15:22:22	Job ID: <SLURM_JOB_ID>	# GPUs: 8	Starting job
    2026-08-22 15:32:22	Job ID: ...	# GPUs: 8	Saved checkpoint	Iteration: 100	Job throughput: 1.2 TFLOP/s/GPU
        Cumulative throughput: 1.1 TFLOP/s/GPU	Floating-point operations: 3.20e+15	Tokens (in billions): 0.01

(one line, as written). The format and the cumulative throughput's start (the first job of the current run
of jobs at this world size, and the operations done before it) follow Megatron-LM HEAD's
append_to_progress_log (megatron/training/utils/log_utils.py), compute_throughputs_and_append_to_progress_log
and get_start_time_from_progress_log (megatron/training/training.py). The floating-point operations so far
are counted per iteration (training/logging.py flops_per_iteration) and kept in the checkpoint's common
state under Megatron-LM's key, num_floating_point_operations_so_far.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from ..checkpoint.progress_log import FILE, STAMP, append


def _field(token: str, kind):
    return kind(token.split(": ")[1])


def run_start(path: str, world_size: int) -> tuple[datetime.datetime, float]:
    """(start time, floating-point operations done before it) of the first job of the latest unbroken
    run of jobs at ``world_size``, read from progress.txt (committed saves only)."""
    start = start_flops = None
    latest, pending = 0.0, None
    with open(path) as f:
        for line in f:
            tokens = line.rstrip("\n").split("\t")
            event = tokens[3]
            if event == "Saved checkpoint":
                latest = _field(tokens[7], float)
            elif event == "Saving async checkpoint":
                pending = _field(tokens[7], float)
            elif event == "Saved async checkpoint" and pending is not None:
                latest, pending = pending, None
            if _field(tokens[2], int) != world_size:
                start = start_flops = None
            elif event == "Starting job" and start is None:
                start, start_flops = tokens[0], latest
    if start is None:
        raise ValueError(f"{path}: no 'Starting job' line at world size {world_size}")
    return datetime.datetime.strptime(start, STAMP), start_flops


class Progress:
    """The job's floating-point operations so far, and its progress.txt lines with --log-progress."""

    def __init__(self, args, flops_so_far: float = 0.0):
        self.args, self.flops, self.job_flops = args, float(flops_so_far), float(flops_so_far)
        self.started = time.time()
        self.on = bool(args.log_progress and args.save)
        if self.on:
            append(args.save, "Starting job")

    def add(self, flops: float) -> None:
        self.flops += flops

    def saved(self, iteration: int, consumed_samples: int) -> None:
        """After a save (Megatron-LM: 'Saving async checkpoint' while an --async-save is still writing)."""
        if not self.on:
            return
        args, world = self.args, dist.get_world_size()
        job = (self.flops - self.job_flops) / ((time.time() - self.started) * 10**12 * world)
        cumulative = 0.0
        if dist.get_rank() == 0:
            start, start_flops = run_start(os.path.join(args.save, FILE), world)
            seconds = max((datetime.datetime.now() - start).total_seconds(), 1e-9)
            cumulative = (self.flops - start_flops) / (seconds * 10**12 * world)
        event = "Saving async checkpoint" if args.async_save else "Saved checkpoint"  # committed: async_saved
        append(
            args.save,
            f"{event}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\tFloating-point operations: {self.flops:.2e}\t"
            f"Tokens (in billions): {consumed_samples * args.seq_length / 10**9:.2f}",
        )

    def async_saved(self, iteration: int | None) -> None:
        """An --async-save's files are complete: its operations count from now on (Megatron-LM's line)."""
        if self.on and iteration is not None:
            append(self.args.save, f"Saved async checkpoint\tIteration: {iteration}")
