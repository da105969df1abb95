"""Megatron-LM's rules for resuming: which arguments a checkpoint brings (``--use-checkpoint-args``,
applied to the namespace by training/loop.py), which must match (the model's shape), and how a
changed schedule is treated (``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``).
Both sides are compared as checkpoints store arguments (state.args_dict)."""

from __future__ import annotations

from .settings import CheckpointSettings

# The model's shape: a checkpoint of another shape cannot load (matches the architecture arguments
# megatron/training/checkpointing.py: load_args_from_checkpoint copies at core_v0.16.1).
SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    # An MoE model's shape (the same file, core_v0.16.1: load_args_from_checkpoint's MoE block).
    "num_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
)
# What --use-checkpoint-args copies besides the shape (Megatron-LM's list, same file).
MODEL_ARGS = SHAPE_ARGS + (
    "seq_length",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "apply_layernorm_1p",
    "norm_epsilon",
    "openai_gelu",
    "squared_relu",
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "bf16",
    "fp16",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
)
# Scheduler values Megatron-LM's OptimizerParamScheduler checks on load, plus the global batch size,
# whose change would skip or repeat samples.
SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd")
SCHEDULE_KEYS += ("wd_incr_style", "wd_incr_steps")


def check_same_model(run_args: dict, saved: dict, where: str) -> None:
    """A checkpoint of another model shape stops the job before any tensor is read; ``run_args`` and
    ``saved`` are this run's and the checkpoint's arguments as checkpoints store them."""
    differ = [
        f"--{key.replace('_', '-')}: checkpoint {saved[key]!r}, this run {run_args.get(key)!r}"
        for key in SHAPE_ARGS
        if key in saved and run_args.get(key) != saved[key]
    ]
    if differ:
        raise ValueError(f"checkpoint {where} was saved for another model: " + "; ".join(differ))


def check_schedule(
    settings: CheckpointSettings, scheduler, saved_scheduler: dict, saved_args: dict, where: str
) -> None:
    """Megatron-LM's rule, stated up front: a resume whose schedule differs stops naming every value
    that differs, unless --override-opt_param-scheduler (this run's values) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's) says which to use."""
    if settings.override_opt_param_scheduler or settings.use_checkpoint_opt_param_scheduler:
        return
    run_args = settings.run_args
    now = scheduler.state_dict()
    differ = [
        f"{key}: checkpoint {saved_scheduler[key]}, this run {now[key]}"
        for key in SCHEDULE_KEYS
        if key in saved_scheduler and saved_scheduler[key] != now[key]
    ]
    for key in ("global_batch_size", "train_iters", "train_samples", "lr"):
        if key in saved_args and saved_args[key] != run_args.get(key):
            differ.append(f"--{key.replace('_', '-')}: checkpoint {saved_args[key]}, this run {run_args.get(key)}")
    if differ:
        raise SystemExit(
            f"--load {where}: the learning-rate schedule differs from the checkpoint's ("
            + "; ".join(differ)
            + "). Pass --override-opt_param-scheduler to use this run's values or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's."
        )
