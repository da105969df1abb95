"""Megatron-LM's run flags: training, learning rate, checkpointing, distributed, validation,
data, tokenizer and logging; names, dests and defaults as in megatron/training/arguments.py
at core_v0.16.1 (newer spellings from HEAD where noted)."""

from __future__ import annotations

import argparse

from .types import nonnegative_float, nonnegative_int, positive_int, probability, signal_name

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "NullTokenizer",
)


def add_training_args(p: argparse.ArgumentParser, optimizers) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=positive_int, default=None)
    g.add_argument("--global-batch-size", type=positive_int, default=None, help="default: micro batch x DP size")
    g.add_argument(
        "--rampup-batch-size",
        type=positive_int,
        nargs=3,
        default=None,
        metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
    )
    g.add_argument(
        "--step-batch-size-schedule",
        default=None,
        metavar='"TOKENS:BATCH ..."',
        help='Megatron-LM HEAD\'s step-wise global batch size, e.g. "0:16 2.4B:320 12B:1536": from each token '
        "count on (suffixes K, M, B, T) the batch size after it; the first threshold is 0",
    )
    g.add_argument("--train-iters", type=positive_int, default=None)
    g.add_argument("--train-samples", type=positive_int, default=None)
    g.add_argument("--exit-interval", type=positive_int, default=None)
    g.add_argument("--exit-duration-in-mins", type=positive_int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="on --exit-signal: save a checkpoint and exit")
    g.add_argument(
        "--exit-signal",
        type=signal_name,
        default="SIGTERM",
        metavar="SIGNAL",
        help="the signal --exit-signal-handler acts on (a name such as SIGUSR1, or its number)",
    )
    g.add_argument(
        "--optimizer",
        default="adam",
        choices=[*optimizers, "dist_muon"],
        help="adam is AdamW; muon puts the hidden matrices on Muon and the rest on AdamW; dist_muon is "
        "muon (Megatron-LM's deprecated spelling)",
    )
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--manual-gc", action="store_true")
    g.add_argument("--manual-gc-interval", type=nonnegative_int, default=0)
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", dest="manual_gc_eval", action="store_false")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--deterministic-mode", action="store_true")
    g.add_argument("--skip-train", action="store_true")


def add_learning_rate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=nonnegative_float, default=None)
    g.add_argument("--min-lr", type=nonnegative_float, default=0.0)
    g.add_argument(
        "--lr-decay-style", default="linear", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    )
    g.add_argument(
        "--lr-wsd-decay-style", default="exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"]
    )
    g.add_argument("--lr-decay-iters", type=positive_int, default=None)
    g.add_argument("--lr-decay-samples", type=positive_int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=positive_int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=positive_int, default=None)
    g.add_argument("--lr-warmup-fraction", type=probability, default=None)
    g.add_argument("--lr-warmup-iters", type=nonnegative_int, default=0)
    g.add_argument("--lr-warmup-samples", type=nonnegative_int, default=0)
    g.add_argument("--lr-warmup-init", type=nonnegative_float, default=0.0)
    g.add_argument(
        "--decoupled-lr",
        type=nonnegative_float,
        default=None,
        help="lr of the input and output embeddings (megatron's is_decoupled_lr groups)",
    )
    g.add_argument("--decoupled-min-lr", type=nonnegative_float, default=None)
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        dest="override_opt_param_scheduler",
        action="store_true",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        dest="use_checkpoint_opt_param_scheduler",
        action="store_true",
    )


def add_checkpointing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument(
        "--save-interval", "--persistent-save-interval", dest="save_interval", type=positive_int, default=None
    )
    g.add_argument("--save-retain-interval", type=positive_int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--pretrained-checkpoint", default=None)
    g.add_argument("--ckpt-step", type=nonnegative_int, default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        "--disable-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args",
        action="store_false",
        help="with --use-checkpoint-args: keep this command line's --tokenizer-model",
    )
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"])
    g.add_argument("--auto-detect-ckpt-format", action="store_true")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save_deprecated", action="store_true")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true")
    g.add_argument(
        "--dist-ckpt-strictness",
        default="assume_ok_unexpected",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
    )
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")
    # Ours. Megatron-LM's --verify-integrity (HEAD, megatron/training/config/training_config.py) is an
    # opt-in, default off, whose rank 0 hashes every file with sha256; here checks are on by default.
    g.add_argument(
        "--no-verify-checkpoint-integrity",
        dest="verify_checkpoint_integrity",
        action="store_false",
        help="do not check --load's files against their checksums before reading (saves still record them). "
        "Risk: a damaged or truncated file is then read as is, giving wrong weights or a failure inside torch "
        "instead of an error naming the file",
    )


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=positive_int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=nonnegative_int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=nonnegative_int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        dest="microbatch_group_size_per_vp_stage",
        type=positive_int,
        default=None,
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false")
    g.add_argument(
        "--overlap-p2p-communication-warmup-flush", dest="overlap_p2p_comm_warmup_flush", action="store_true"
    )
    g.add_argument(
        "--no-align-grad-reduce", "--disable-align-grad-reduce", dest="align_grad_reduce", action="store_false"
    )
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true")
    g.add_argument(
        "--distributed-backend",
        default="nccl",
        choices=["nccl", "gloo"],
        help="nccl needs CUDA: without it gloo runs, with a notice",
    )
    g.add_argument("--distributed-timeout-minutes", type=positive_int, default=10)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true")
    g.add_argument("--ddp-average-in-collective", action="store_true")
    g.add_argument("--ddp-bucket-size", type=positive_int, default=None)
    g.add_argument("--num-distributed-optimizer-instances", type=positive_int, default=1)
    g.add_argument("--disable-gloo-process-groups", dest="enable_gloo_process_groups", action="store_false")
    g.add_argument("--local-rank", type=nonnegative_int, default=0, help="set by older launchers; torchrun's env wins")


def add_validation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=nonnegative_int, default=100)
    g.add_argument("--eval-interval", type=positive_int, default=None)
    g.add_argument(
        "--start-eval-at-iter",
        type=nonnegative_int,
        default=None,
        help="evaluate during training only from this iteration on (the final evaluation always runs)",
    )


def add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="prefixes of .bin/.idx datasets, optionally weighted: W1 P1 W2 P2 ...; default: the "
        "embedded corpus built from this machine's Python sources",
    )
    g.add_argument("--split", default=None, help="train,valid,test weights; default with --data-path: 969, 30, 1")
    g.add_argument("--data-args-path", default=None, help="a file holding --data-path's words (weights and prefixes)")
    g.add_argument(
        "--per-split-data-args-path",
        default=None,
        help='a JSON file {"train": ..., "valid": ..., "test": ...} holding the --*-data-path words of each split',
    )
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false")
    g.add_argument(
        "--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader", action="store_false"
    )
    g.add_argument("--num-workers", type=nonnegative_int, default=2, help="DataLoader worker processes")
    g.add_argument("--num-dataset-builder-threads", type=positive_int, default=1)
    g.add_argument("--seq-length", type=positive_int, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--dataloader-type", default=None, choices=["single", "cyclic"])
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=positive_int, default=None)
    g.add_argument("--vocab-extra-ids", type=nonnegative_int, default=0)
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None)
    g.add_argument("--tiktoken-pattern", default=None)
    g.add_argument("--tiktoken-num-special-tokens", type=nonnegative_int, default=1000)
    g.add_argument("--trust-remote-code", action="store_true", help="HuggingFaceTokenizer: run the folder's code")
    # Megatron-LM 0.16.1 reads these in preprocess_data.py only; its training builds the tokenizers of
    # megatron/training/tokenizer/tokenizer.py whatever they say, and so do we.
    for flag in (
        "--legacy-tokenizer",
        "--tokenizer-sentencepiece-legacy",
        "--tokenizer-hf-use-fast",
        "--tokenizer-hf-include-special-tokens",
    ):
        g.add_argument(flag, action="store_true", help="tools/preprocess_data.py's; training's tokenizer ignores it")
    g.add_argument("--tokenizer-metadata", default=None, help="tools/preprocess_data.py's; training ignores it")


def add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=positive_int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-max-attention-logit", action="store_true", help="the step's largest attention logit")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument(
        "--no-log-loss-scale-to-tensorboard",
        "--disable-log-loss-scale-to-tensorboard",
        dest="log_loss_scale_to_tensorboard",
        action="store_false",
    )
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"])
    g.add_argument(
        "--no-barrier-with-level-1-timing",
        dest="barrier_with_L1_time",
        action="store_false",
        help="level-1 timers start without a barrier (megatron-core's optimizer and schedules read it)",
    )
    g.add_argument(
        "--log-progress",
        action="store_true",
        help="append job starts and, at each save, throughput, floating-point operations and tokens so far to "
        "progress.txt in --save (Megatron-LM's format)",
    )
    g.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="level of Python's root logger (10 debug, 20 info, 30 warning); else $MEGATRON_LOGGING_LEVEL",
    )
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=positive_int, default=1)
    g.add_argument("--tensorboard-queue-size", type=positive_int, default=1000)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--wandb-entity", default=None)
    # megatron/training/common_config.py ProfilingConfig at core_v0.16.1
    g.add_argument(
        "--profile",
        action="store_true",
        help="nsys mode: cudaProfilerStart/Stop around iterations --profile-step-start+1..end on --profile-ranks, "
        "for nsys profile -s none -t nvtx,cuda --capture-range=cudaProfilerApi --capture-range-end=stop",
    )
    g.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="with --profile: torch.profiler instead; a chrome trace (*.pt.trace.json) in --tensorboard-dir "
        "(else --output-dir), for Perfetto or TensorBoard",
    )
    g.add_argument("--profile-step-start", type=nonnegative_int, default=10, help="global step to start profiling")
    g.add_argument("--profile-step-end", type=nonnegative_int, default=12, help="global step to stop profiling")
    g.add_argument("--profile-ranks", type=nonnegative_int, nargs="+", default=[0], help="global ranks to profile")
