"""megatron-core dist_checkpointing of the optimizer state: keys are global parameter
names and shards are element ranges, so what one DP size saves another loads (see
MatrixFSDPOptimizer.sharded_state_dict)."""

from __future__ import annotations

import os

from ..compat.cpu import cuda_on_cpu


def save_optimizer_distributed(optimizer, checkpoint_dir: str) -> None:
    """Save the optimizer's state with megatron-core dist_checkpointing (collective).
    Keys are global parameter names and shards are element ranges, so the result
    loads at another DP size (see MatrixFSDPOptimizer.sharded_state_dict)."""
    from megatron.core import dist_checkpointing

    os.makedirs(checkpoint_dir, exist_ok=True)
    with cuda_on_cpu():
        dist_checkpointing.save(optimizer.sharded_state_dict(), checkpoint_dir)


def load_optimizer_distributed(optimizer, checkpoint_dir: str) -> None:
    """Load what :func:`save_optimizer_distributed` wrote, into this rank's pieces."""
    from megatron.core import dist_checkpointing

    with cuda_on_cpu():
        loaded = dist_checkpointing.load(optimizer.sharded_state_dict(is_loading=True), checkpoint_dir)
    optimizer.load_sharded_state_dict(loaded)
