"""What ``--distributed-timeout-minutes`` has to cover (issue 21, item 3).

The process group's time-out bounds every wait in a collective (NCCL's watchdog kills the job past
it). No checkpoint, planner or set-up step holds the other ranks for longer than one rank's own
share of the work: a save's ranks each write and hash their own files, a load's ranks each verify
their share (checkpoint/integrity.py), and the plan agreement exchanges one digest per rank. So
the time-out must exceed the largest rank share's write and hash, which this start-up line states
from the checkpoint this run resumes from (its manifest), or says will be printed with each save."""

from __future__ import annotations

import os

import torch.distributed as dist

from ..checkpoint import files, integrity

_GB = 1e9


def _last_checkpoint(args) -> tuple[str, dict] | None:
    """(folder, manifest) of the checkpoint --load (else --save) names, if it has one of ours."""
    for root, step in ((args.load, args.ckpt_step), (args.save, None)):
        target = files.load_target(root, step) if root else None
        if target and os.path.isfile(os.path.join(target[0], integrity.MANIFEST)):
            try:
                return target[0], files.read_manifest(target[0])
            except (OSError, ValueError):
                return None
    return None


def _shares(args, world: int) -> str:
    found = _last_checkpoint(args)
    if found is None:
        return "no checkpoint of ours yet: each save's line prints its largest rank share"
    folder, manifest = found
    written = integrity.rank_bytes(manifest["files"])
    rank, largest = max(written.items(), key=lambda kv: (kv[1], -kv[0]))
    text = f"largest rank share {largest / _GB:.3f} GB at the last save, {os.path.basename(folder)}, rank {rank}"
    if not getattr(args, "verify_checkpoint_integrity", True):
        return text + "; --load's files not verified: --no-verify-checkpoint-integrity"
    loads = integrity.assign(manifest["files"], world)[1]
    return text + f"; {max(loads) / _GB:.3f} GB to verify on the busiest of {world} ranks"


def timeout_line(args, world: int) -> str:
    """The start-up line: what the time-out covers and the largest per-rank checkpoint share."""
    return (
        f"> distributed timeout {args.distributed_timeout_minutes} min (--distributed-timeout-minutes) bounds each "
        "collective wait; a checkpoint holds the others only for one rank's own share: each rank writes and "
        f"hashes ({integrity.HASH}) its own files and verifies its share before a load ({_shares(args, world)}); "
        "rank 0 adds the small common files and the manifest; set-up and the plan agreement exchange digests"
    )


def print_timeout_line(args) -> None:
    """Print :func:`timeout_line` once, on rank 0 (only rank 0 reads the manifest)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(timeout_line(args, world), flush=True)
