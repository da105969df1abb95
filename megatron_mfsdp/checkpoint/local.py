"""``--ckpt-format torch``: one file per rank of this exact layout, fast to write and read.

``SAVE/iter_0000100/rank_00000.pt`` holds the rank's weight segments, optimizer state, scheduler,
generator states and the arguments, all tensors and plain values (read back with
``weights_only=True``). The folder is written like a torch_dist one (files.py: temporary folder,
checksums taken while each rank writes its file, tracker last). It loads only at the same layout:
the plan digests are checked."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import integrity, resume
from . import state as ckpt_state


def rank_file(rank: int) -> str:
    """The file of ``rank``, relative to the iteration folder."""
    return f"rank_{rank:05d}.pt"


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, rank_file(rank))


def rank_state(args, iteration: int, chunks, optimizer, scheduler, consumed) -> dict:
    if not hasattr(chunks[0], "units"):
        raise ValueError("--ckpt-format torch is for --use-matrix-fsdp and Muon runs; use torch_dist (the default)")
    saved_args = ckpt_state.args_dict(args)
    saved_args["consumed_train_samples"], saved_args["consumed_valid_samples"] = consumed
    return {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "plan_digest": [chunk.plan.digest() for chunk in chunks],
        "model": [unit.param_segment.clone() for chunk in chunks for unit in chunk.units],
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng": ckpt_state.rng_tensors(),
        "args": saved_args,
    }


def save_rank_file(folder: str, state: dict) -> dict:
    """Write this rank's file, hashing the bytes as torch.save hands them over (no read-back), and
    fsync it; returns its manifest entry {file: entry}."""
    rank = dist.get_rank()
    with integrity.HashingWriter(_path(folder, rank), rank) as f:
        torch.save(state, f)
    return {rank_file(rank): f.entry()}


def read_args(folder: str) -> dict:
    return torch.load(_path(folder, 0), map_location="cpu", weights_only=True)["args"]


def load_rank_file(args, folder: str, chunks, optimizer, scheduler) -> dict:
    """Load this rank's file (already checksum-verified) into the job; returns the saved state."""
    path = _path(folder, dist.get_rank())
    if not os.path.isfile(path):
        raise ValueError(f"--load: {path} is missing (saved with another world size? use --ckpt-format torch_dist)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    resume.check_same_model(args, state["args"], path)
    if state["world_size"] != dist.get_world_size() or state["plan_digest"] != [c.plan.digest() for c in chunks]:
        raise ValueError(
            f"--load: {path} was saved with another layout (world size, DP size, planner, parameter rules, "
            "Q/K/V owners); --ckpt-format torch loads only at the layout that saved it, torch_dist (the default) at any"
        )
    with torch.no_grad():
        for unit, segment in zip([u for chunk in chunks for u in chunk.units], state["model"]):
            unit.param_segment.copy_(segment)
    if not (args.finetune or args.no_load_optim):
        resume.check_schedule(args, scheduler, state["opt_param_scheduler"], state["args"], folder)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if not (args.finetune or args.no_load_rng):
        ckpt_state.set_rng_tensors(state["rng"])
    return state
