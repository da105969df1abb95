"""Megatron-LM's rules for resuming: which arguments a checkpoint brings (``--use-checkpoint-args``),
which must match (the model's shape), and how a changed schedule is treated
(``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``)."""

from __future__ import annotations

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
)
# Scheduler values Megatron-LM's OptimizerParamScheduler checks on load, plus the global batch size,
# whose change would skip or repeat samples.
SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd")
SCHEDULE_KEYS += ("wd_incr_style", "wd_incr_steps")


def apply_checkpoint_args(args, saved: dict) -> list[str]:
    """--use-checkpoint-args: take the model's arguments from the checkpoint; returns what changed.
    --no-use-tokenizer-model-from-checkpoint-args keeps this run's --tokenizer-model (Megatron-LM's
    load_args_from_checkpoint at HEAD)."""
    changed = []
    keep_tokenizer = not getattr(args, "use_tokenizer_model_from_checkpoint_args", True)
    for key in MODEL_ARGS:
        if keep_tokenizer and key == "tokenizer_model":
            continue
        if key in saved and getattr(args, key, None) != saved[key]:
            changed.append(f"--{key.replace('_', '-')} {saved[key]}")
            setattr(args, key, saved[key])
    return changed


def check_same_model(args, saved: dict, where: str) -> None:
    """A checkpoint of another model shape stops the job before any tensor is read."""
    differ = [
        f"--{key.replace('_', '-')}: checkpoint {saved[key]!r}, this run {getattr(args, key, None)!r}"
        for key in SHAPE_ARGS
        if key in saved and getattr(args, key, None) != saved[key]
    ]
    if differ:
        raise ValueError(f"checkpoint {where} was saved for another model: " + "; ".join(differ))


def check_schedule(args, scheduler, saved_scheduler: dict, saved_args: dict, where: str) -> None:
    """Megatron-LM's rule, stated up front: a resume whose schedule differs stops naming every value
    that differs, unless --override-opt_param-scheduler (this run's values) or
    --use-checkpoint-opt_param-scheduler (the checkpoint's) says which to use."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    now = scheduler.state_dict()
    differ = [
        f"{key}: checkpoint {saved_scheduler[key]}, this run {now[key]}"
        for key in SCHEDULE_KEYS
        if key in saved_scheduler and saved_scheduler[key] != now[key]
    ]
    for key in ("global_batch_size", "train_iters", "train_samples", "lr"):
        if key in saved_args and saved_args[key] != getattr(args, key, None):
            differ.append(
                f"--{key.replace('_', '-')}: checkpoint {saved_args[key]}, this run {getattr(args, key, None)}"
            )
    if differ:
        raise SystemExit(
            f"--load {where}: the learning-rate schedule differs from the checkpoint's ("
            + "; ".join(differ)
            + "). Pass --override-opt_param-scheduler to use this run's values or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's."
        )
