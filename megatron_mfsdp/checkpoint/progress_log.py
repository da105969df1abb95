"""--log-progress's ``progress.txt`` in the --save folder: one tab-separated line per event, written
by rank 0 (Megatron-LM HEAD's append_to_progress_log, megatron/training/utils/log_utils.py). The
training loop writes its events (training/progress.py); a save that retires the checkpoint the
tracker named before writes its own (job.py), so the writer lives here, below both."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

FILE = "progress.txt"
STAMP = "%Y-%m-%d %H:%M:%S"  # each line's first field


def append(save_dir: str | None, text: str, barrier: bool = True) -> None:
    """One line, after a barrier (unless ``barrier`` is False: rank 0 alone calls), from rank 0
    (Megatron-LM's append_to_progress_log)."""
    if save_dir is None:
        return
    if barrier:
        dist.barrier()
    if dist.get_rank() != 0:
        return
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, FILE), "a") as f:
        job = os.environ.get("SLURM_JOB_ID", "")
        f.write(f"{datetime.datetime.now():{STAMP}}\tJob ID: {job}\t# GPUs: {dist.get_world_size()}\t{text}\n")
