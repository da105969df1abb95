"""Checkpoints that reshard and lose nothing.

- ``save_checkpoint(settings, iteration, chunks, optimizer, scheduler, consumed)`` and
  ``load_checkpoint(settings, chunks, optimizer, scheduler)`` (``settings``: a CheckpointSettings,
  settings.py): a training job's checkpoint in
  ``--ckpt-format torch_dist`` (megatron-core dist_checkpointing, Megatron-LM's layout, loads at
  any TP x PP x DP) or ``torch`` (per-rank files of one layout); collective.
- ``read_model_checkpoint(load_dir)`` -> (stored args, {state-dict name: full tensor}) and
  ``write_model_checkpoint(save_dir, stored_args, tensors)``: the whole model at 1 x 1 x 1 from or to
  any layout's torch_dist checkpoint, for conversion (model_files.py).

Folders are written atomically (files.py) with checksums each rank takes of the files it writes
and verifies a share of at load (integrity.py); see docs/design.md, "Checkpoints"."""

from .files import TRACKER, read_tracker, verify_manifest
from .job import finalize_async_save, load_checkpoint, read_checkpoint_args, save_checkpoint
from .model_files import CheckpointError, read_model_checkpoint, write_model_checkpoint
from .settings import CheckpointSettings

__all__ = [
    "CheckpointError",
    "CheckpointSettings",
    "TRACKER",
    "finalize_async_save",
    "load_checkpoint",
    "read_checkpoint_args",
    "read_model_checkpoint",
    "read_tracker",
    "save_checkpoint",
    "verify_manifest",
    "write_model_checkpoint",
]
