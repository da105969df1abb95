"""What tests and benchmarks share: gloo workers and collective counting (workers), a
tiny GPT and its data (tiny), the single-process reference trainer (reference) and the
Muon baselines (baselines), dist checkpoints of a chunk (checkpoints)."""

from .checkpoints import dist_checkpoint
from .reference import assemble_optimizer_state, reference_train
from .tiny import (
    MBS,
    SEQ,
    VOCAB,
    forward_step,
    init_megatron,
    lm_loss,
    micro_batch,
    optimizer_config,
    tiny_gpt,
    tiny_gpt_config,
)
from .workers import Call, CallLog, count_collectives, free_port, run_workers  # counting: runtime/call_log.py

__all__ = [
    "dist_checkpoint",
    "assemble_optimizer_state",
    "reference_train",
    "MBS",
    "SEQ",
    "VOCAB",
    "init_megatron",
    "forward_step",
    "lm_loss",
    "micro_batch",
    "optimizer_config",
    "tiny_gpt",
    "tiny_gpt_config",
    "Call",
    "CallLog",
    "count_collectives",
    "free_port",
    "run_workers",
]
