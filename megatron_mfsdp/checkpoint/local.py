"""Per-rank checkpoints, written atomically.

Layout (Megatron-LM's folder and tracker names)::

    SAVE/iter_0000100/rank_00000.pt    this rank's segments, optimizer and scheduler state
    SAVE/latest_checkpointed_iteration.txt

Each file is written to a temporary name and renamed; the tracker file is
replaced only after every rank has renamed its file, so a save that fails part
way leaves the previous checkpoint the one that loads. These files are tied to
the layout (DP size, planner, model): loading checks the plan digest.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(save_dir: str, iteration: int, chunks, optimizer, scheduler, args) -> str:
    rank = dist.get_rank()
    folder = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    state = {
        "iteration": iteration,
        "plan_digest": [chunk.plan.digest() for chunk in chunks],
        "model": [unit.param_segment.clone() for chunk in chunks for unit in chunk.units],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    _atomic_save(state, os.path.join(folder, f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(save_dir, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(save_dir, TRACKER))
    dist.barrier()
    return folder


def load_checkpoint(load_dir: str, chunks, optimizer, scheduler) -> int | None:
    """Load the latest checkpoint in ``load_dir``; return its iteration, or None if there is none."""
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        iteration = int(f.read().strip())
    path = os.path.join(load_dir, f"iter_{iteration:07d}", f"rank_{dist.get_rank():05d}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--load {load_dir}: {path} is missing (saved with a different world size?)")
    state = torch.load(path, weights_only=False)
    if state["plan_digest"] != [chunk.plan.digest() for chunk in chunks]:
        raise ValueError(
            f"--load {load_dir}: checkpoint was saved with a different MatrixFSDP layout "
            "(DP size, planner, parameter rules or model shape)"
        )
    with torch.no_grad():
        for unit, segment in zip([u for chunk in chunks for u in chunk.units], state["model"]):
            unit.param_segment.copy_(segment)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return iteration
