"""Command-line flags: Megatron-LM's names and meanings where they exist, plus ours.

Everything is checked here, before any process group, model or dataset is
built, and each error names the flag that is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import os


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a megatron-core GPT with MatrixFSDP (owner-sharded ZeRO-3 + Muon). "
        "With no data flags it builds a small corpus from this machine's Python sources "
        "and trains a tiny GPT on it.",
    )
    _add_model_args(p)
    _add_training_args(p)
    _add_precision_args(p)
    _add_parallel_args(p)
    _add_data_args(p)
    _add_logging_args(p)
    _add_mfsdp_args(p)
    _add_muon_args(p)
    return p


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument(
        "--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute"
    )
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--use-cpu-initialization", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batches and schedule")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP size")
    g.add_argument("--train-iters", type=int, default=300)
    g.add_argument("--lr", type=float, default=None, help="default: 3e-3 (Muon) / 1e-3 (adam)")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="cosine"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=20)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)


def _add_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved 1F1B: each pipeline rank holds several model chunks of this many layers",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--distributed-backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo"
    )
    g.add_argument(
        "--deterministic-mode", action="store_true", help="deterministic kernels (torch.use_deterministic_algorithms)"
    )


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="indexed dataset prefixes (optionally weighted: W1 P1 W2 P2); "
        "default: the embedded corpus built from this machine's Python sources",
    )
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "NullTokenizer"], default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size of NullTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=int, default=0)


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, evaluation and checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--output-dir", default="runs/default", help="logs and the loss-curve PNG go here")


def _field(cls, name: str):
    """A config dataclass field: the command line's default and choices come from it."""
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _default(cls, name: str):
    return _field(cls, name).default


def _choices(cls, name: str):
    return list(_field(cls, name).metadata["choices"])


def _add_muon_args(p: argparse.ArgumentParser) -> None:
    from ..config import MatrixFSDPOptimizerConfig as O

    g = p.add_argument_group("Muon")
    g.add_argument("--muon-momentum", type=float, default=_default(O, "muon_momentum"))
    g.add_argument(
        "--muon-nesterov", dest="muon_nesterov", action="store_true", default=_default(O, "muon_use_nesterov")
    )
    g.add_argument("--no-muon-nesterov", dest="muon_nesterov", action="store_false")
    g.add_argument("--muon-ns-steps", type=int, default=_default(O, "muon_num_ns_steps"))
    g.add_argument(
        "--muon-coefficients", choices=_choices(O, "muon_coefficients"), default=_default(O, "muon_coefficients")
    )
    g.add_argument(
        "--muon-ns-dtype",
        choices=_choices(O, "muon_ns_dtype"),
        default=None,
        help="default: bf16 with CUDA, fp32 on CPU",
    )
    g.add_argument("--muon-scale-mode", choices=_choices(O, "muon_scale_mode"), default=_default(O, "muon_scale_mode"))
    g.add_argument("--muon-extra-scale-factor", type=float, default=_default(O, "muon_extra_scale_factor"))
    g.add_argument(
        "--muon-split-qkv", dest="muon_split_qkv", action="store_true", default=_default(O, "muon_split_qkv")
    )
    g.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false")
    g.add_argument(
        "--muon-tp-mode",
        choices=_choices(O, "muon_tp_mode"),
        default=_default(O, "muon_tp_mode"),
        help="blockwise: Newton-Schulz on each TP shard, no communication (results depend on "
        "the TP size); distributed: exact full-matrix Muon, Gram matrices all-reduced over "
        "TP each iteration; duplicated: all-gather over TP, orthogonalize, keep the slice",
    )


def _add_mfsdp_args(p: argparse.ArgumentParser) -> None:
    from ..config import MatrixFSDPConfig as R
    from ..config import MatrixFSDPOptimizerConfig as O
    from ..optim import registry

    g = p.add_argument_group("MatrixFSDP and Muon (ours)")
    g.add_argument(
        "--use-matrix-fsdp",
        action="store_true",
        help="owner-sharded ZeRO-3; without it, plain data parallelism (every rank holds "
        "and updates everything). The embedded default run turns it on.",
    )
    g.add_argument(
        "--optimizer",
        choices=registry.optimizer_choices(),
        default=_default(O, "optimizer"),
        help="muon: Muon on 2D weights and AdamW on the rest; adam: AdamW everywhere",
    )
    g.add_argument("--mfsdp-planner", choices=_choices(R, "planner"), default=_default(R, "planner"))
    g.add_argument(
        "--mfsdp-replicate-size",
        type=int,
        default=1,
        help="hybrid sharding: owners within groups of DP/R ranks, R replicas across them",
    )
    g.add_argument(
        "--mfsdp-param-rule",
        action="append",
        default=[],
        metavar="PATTERN=RULE",
        help="put parameters whose name matches PATTERN (fnmatch) under update rule RULE "
        f"({', '.join(registry.rule_names())})",
    )
    g.add_argument(
        "--mfsdp-no-verify-collectives",
        dest="mfsdp_verify_collectives",
        action="store_false",
        default=_default(R, "verify_collectives"),
        help="skip the per-collective signature check",
    )


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to $WORLD_SIZE (torchrun) or 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def validate_args(args: argparse.Namespace) -> None:
    """Fill defaults that depend on other flags and reject bad combinations."""
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    _validate_parallel(args)
    _validate_model(args)
    _validate_schedule(args)
    _validate_ours(args)
    _validate_data_args(args)


def _validate_parallel(args) -> None:
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage:
        per_vp = args.num_layers_per_virtual_pipeline_stage
        if pp < 2 or (args.num_layers // pp) % per_vp:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_vp} needs "
                f"--pipeline-model-parallel-size > 1 and must divide the {args.num_layers // pp} "
                "layers of each pipeline stage"
            )
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // per_vp
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        args.sequence_parallel = False  # megatron-LM drops it silently too

    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        raise ValueError(
            f"world size {args.world_size} is not divisible by --tensor-model-parallel-size x "
            f"--pipeline-model-parallel-size = {model_parallel}"
        )
    args.data_parallel_size = args.world_size // model_parallel
    if args.data_parallel_size % args.mfsdp_replicate_size:
        raise ValueError(
            f"--mfsdp-replicate-size {args.mfsdp_replicate_size} does not divide the "
            f"data-parallel size {args.data_parallel_size}"
        )


def _validate_model(args) -> None:
    if args.num_attention_heads % args.tensor_model_parallel_size:
        raise ValueError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}"
        )
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}"
        )
    tp = args.tensor_model_parallel_size
    if args.ffn_hidden_size and args.ffn_hidden_size % tp:
        raise ValueError(
            f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if args.make_vocab_size_divisible_by % tp:
        raise ValueError(
            f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} must be a multiple "
            f"of --tensor-model-parallel-size {tp} (the vocabulary is padded the same way at any TP)"
        )
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_query_groups is None or args.num_attention_heads % args.num_query_groups:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads {args.num_attention_heads}"
        )
    if args.num_query_groups % tp:
        raise ValueError(
            f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}"
        )
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}"
        )


def _validate_schedule(args) -> None:
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "muon" else 1e-3
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        raise ValueError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than --lr-decay-iters "
            f"{args.lr_decay_iters} (default: --train-iters)"
        )
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")


def _validate_ours(args) -> None:
    import torch

    args.muon_ns_dtype = args.muon_ns_dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    args.distributed_backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    from ..optim import registry
    from ..placement.rules import parse_rule
    from .setup import optimizer_config, runtime_config

    args.param_rules = [parse_rule(rule, registry.rule_names()) for rule in args.mfsdp_param_rule]
    # Values are checked by the configs' own validation (one source of truth).
    runtime_config(args)
    optimizer_config(args)


def _validate_data_args(args) -> None:
    default_data = not args.data_path and not args.mock_data
    args.use_default_data = default_data
    if default_data and args.tokenizer_model:
        raise ValueError(
            "--tokenizer-model given without --data-path or --mock-data: the embedded "
            "default data brings its own tokenizer"
        )
    if default_data:
        # The embedded default demonstrates MatrixFSDP + Muon; it is not a baseline run.
        args.use_matrix_fsdp = True
        args.tokenizer_type = "SentencePieceTokenizer"
        return
    if args.data_path:
        paths = [p for p in args.data_path if not _is_number(p)]
        for prefix in paths:
            for ext in (".bin", ".idx"):
                path = prefix + ext
                if not os.path.isfile(path) or not os.access(path, os.R_OK):
                    raise ValueError(f"--data-path {prefix}: {path} is missing or unreadable")
    args.tokenizer_type = args.tokenizer_type or ("NullTokenizer" if args.mock_data else "SentencePieceTokenizer")
    if args.tokenizer_type == "SentencePieceTokenizer":
        if not args.tokenizer_model:
            raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
        if not os.path.isfile(args.tokenizer_model) or not os.access(args.tokenizer_model, os.R_OK):
            raise ValueError(f"--tokenizer-model {args.tokenizer_model}: file is missing or unreadable")
    elif args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
