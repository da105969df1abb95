"""Checkpoints: per-rank files of one layout (local.py) and megatron-core
dist_checkpointing of the optimizer state by global name (dist.py)."""
