"""Checkpoints that reshard and lose nothing.

- ``save_checkpoint(args, iteration, chunks, optimizer, scheduler, consumed)`` and
  ``load_checkpoint(args, chunks, optimizer, scheduler)``: a training job's checkpoint in
  ``--ckpt-format torch_dist`` (megatron-core dist_checkpointing, Megatron-LM's layout, loads at
  any TP x PP x DP) or ``torch`` (per-rank files of one layout); collective.
- ``read_global_state(load_dir)`` -> (args, {global name: full tensor}) and
  ``write_global_state(save_dir, args, tensors)``: the unsplit model in one process, for conversion.

Folders are written atomically with checksums (files.py); see docs/design.md, "Checkpoints"."""

from .files import TRACKER, read_tracker, verify_manifest
from .global_state import read_global_state, write_global_state
from .job import finalize_async_save, load_checkpoint, read_checkpoint_args, save_checkpoint

__all__ = [
    "TRACKER",
    "finalize_async_save",
    "load_checkpoint",
    "read_checkpoint_args",
    "read_global_state",
    "read_tracker",
    "save_checkpoint",
    "verify_manifest",
    "write_global_state",
]
