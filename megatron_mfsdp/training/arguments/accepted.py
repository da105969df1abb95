"""Megatron-LM flags accepted with a notice, those refused with their reason, and the error for a flag
nobody knows.

Every flag of Megatron-LM's parser (megatron_lm_flags.txt, with its argument group) is exactly one of:

- implemented: pretrain_gpt.py's own parser has it (model_flags.py, run_flags.py, ours.py);
- accepted with a notice: ``NOT_APPLICABLE`` (what happens instead) or ``DEPRECATED`` (Megatron-LM's own
  deprecation text; these are no-ops in Megatron-LM too). Start-up prints one line for each one given;
- refused: refused.py gives the reason; giving the flag exits 2 naming it, before any work (at a value
  in ``refused.HARMLESS`` it parses).

A notice table wins over the parser (a flag we parse but whose effect is elsewhere, e.g.
--ckpt-fully-parallel-load, is a notice) and over refused.py; tests/unit/test_megatron_flag_coverage.py
holds every flag of Megatron-LM HEAD to exactly one set. An unknown flag gets the closest known names.
"""

from __future__ import annotations

import argparse
import difflib
import functools
from importlib import resources

from . import refused

_ASYNC_WRITER = "--async-save writes from megatron-mfsdp's own background thread (one per save), not a worker process"
_PARALLEL_LOAD = (
    "each rank reads the tensors it holds straight from the files (megatron-core's default load); nothing is "
    "exchanged between ranks"
)
_PARALLEL_SAVE = (
    "megatron-core's fully parallel save strategy is not used: with --use-matrix-fsdp each tensor has one owner, "
    "who writes it; otherwise the first data-parallel replica writes"
)
_TP_OVERLAP = "needs Transformer Engine userbuffers on CUDA: TP communication is not overlapped"
_STRAGGLER = "the straggler detector (--log-straggler) is not used: no per-rank throughput report"
_RERUN = "megatron's rerun state machine is not used"
_TOKENIZER_PREPROCESS = (
    "read by tools/preprocess_data.py; training builds Megatron-LM's training tokenizer for --tokenizer-type, "
    "which does not use it"
)

NOT_APPLICABLE = {
    "--rerun-mode": f"{_RERUN}: results are not re-validated (--rerun-mode disabled)",
    "--error-injection-rate": f"{_RERUN}: no errors are injected",
    "--error-injection-type": f"{_RERUN}: no errors are injected",
    "--result-rejected-tracker-filename": _RERUN,
    "--check-for-spiky-loss": f"{_RERUN}: not checked (a non-finite loss still stops the run)",
    "--check-for-large-grads": f"{_RERUN}: not checked (a non-finite gradient norm still stops the run)",
    "--check-weight-hash-across-dp-replicas-interval": "not checked: with --use-matrix-fsdp every weight has one owner",
    "--verify-integrity": "on by default here (--no-verify-checkpoint-integrity turns it off): each rank "
    "checksums the files it writes and verifies its share before a load",
    "--tp-comm-overlap": _TP_OVERLAP,
    "--tp-comm-overlap-cfg": "needs Transformer Engine userbuffers on CUDA: ignored",
    "--tp-comm-overlap-rs-dgrad": _TP_OVERLAP,
    "--tp-comm-bootstrap-backend": _TP_OVERLAP,
    "--disable-tp-comm-bulk-dgrad": _TP_OVERLAP,
    "--disable-tp-comm-bulk-wgrad": _TP_OVERLAP,
    "--disable-tp-comm-overlap-ag": _TP_OVERLAP,
    "--disable-tp-comm-overlap-rs": _TP_OVERLAP,
    "--no-tp-comm-bulk-dgrad": _TP_OVERLAP,
    "--no-tp-comm-bulk-wgrad": _TP_OVERLAP,
    "--no-tp-comm-overlap-ag": _TP_OVERLAP,
    "--no-tp-comm-overlap-rs": _TP_OVERLAP,
    "--symmetric-ar-type": "TP all-reduces use the distributed backend's default (no symmetric-memory all-reduce)",
    "--async-strategy": _ASYNC_WRITER,
    "--async-ckpt-use-cpu-shm": _ASYNC_WRITER,
    "--use-persistent-ckpt-worker": _ASYNC_WRITER,
    "--dist-ckpt-workers": _ASYNC_WRITER,
    "--async-ckpt-cpu-priority": f"{_ASYNC_WRITER}: no writer process to reprioritize",
    "--async-ckpt-io-priority": f"{_ASYNC_WRITER}: no writer process to reprioritize",
    "--ckpt-fully-parallel-load": _PARALLEL_LOAD,
    "--ckpt-fully-parallel-load-exchange-algo": _PARALLEL_LOAD,
    "--ckpt-fully-parallel-load-per-rank-objects": _PARALLEL_LOAD,
    "--ckpt-fully-parallel-load-process-group": _PARALLEL_LOAD,
    "--ckpt-fully-parallel-save-process-group": _PARALLEL_SAVE,
    "--no-ckpt-fully-parallel-save": _PARALLEL_SAVE,
    "--disable-ckpt-fully-parallel-save": _PARALLEL_SAVE,
    "--ckpt-assume-constant-structure": "each save plans its files anew (megatron-core's cached save plans are not "
    "used)",
    "--ckpt-pg-tensors-cache-path": "no parallelization-group cache: each save and load computes its shares",
    "--ckpt-pg-tensors-cache-create": "no parallelization-group cache: each save and load computes its shares",
    "--auto-detect-ckpt-format": "always on here: --load reads the format (torch or torch_dist) from the "
    "checkpoint's manifest",
    "--dist-ckpt-optim-fully-reshardable": "optimizer state is always saved reshardable to any TP x PP x DP "
    "(MatrixFSDP saves each matrix's state whole)",
    "--distrib-optim-fully-reshardable-mem-efficient": "the optimizer state is saved by its owners, no gather",
    "--no-ckpt-load-validate-sharding-integrity": "megatron-core's dist_checkpointing validates the shards as it "
    "loads (default): not turned off",
    "--disable-ckpt-load-validate-sharding-integrity": "megatron-core's dist_checkpointing validates the shards as "
    "it loads (default): not turned off",
    "--ckpt-drop-redundant-extra-state": "Transformer Engine's _extra_state is saved as megatron-core gives it",
    "--dist-ckpt-save-pre-mcore-014": "checkpoints are written in the pinned megatron-core's layout",
    "--no-save-tokenizer-assets": "training checkpoints carry no tokenizer files here (the saved args name them)",
    "--disable-save-tokenizer-assets": "training checkpoints carry no tokenizer files here (the saved args name them)",
    "--use-mp-args-from-checkpoint-args": "the parallel sizes come from this command line: torch_dist "
    "checkpoints load at any TP x PP x DP",
    "--defer-embedding-wgrad-compute": "needs gradient-accumulation fusion (Apex or Transformer Engine): not deferred",
    "--wgrad-deferral-limit": "needs gradient-accumulation fusion (Apex or Transformer Engine): ignored",
    "--delay-wgrad-compute": "weight gradients are computed with the data gradients",
    "--test-mode": "megatron's test-mode checks are not run",
    "--eval-global-batch-size": "evaluation uses --global-batch-size",
    "--eval-micro-batch-size": "evaluation uses --micro-batch-size",
    "--use-flash-attn": "deprecated in Megatron-LM; the attention backend follows --attention-backend",
    "--flash-attention-version": "the attention backend follows --attention-backend (the local spec: PyTorch SDPA)",
    "--use-sharp": "SHARP applies to NCCL on InfiniBand only: not used",
    "--sharp-enabled-group": "SHARP applies to NCCL on InfiniBand only: not used",
    "--nccl-communicator-config-path": "NCCL communicator configs are not applied",
    "--use-nccl-ub": "NCCL user buffers are not registered",
    "--disable-symmetric-registration": "NCCL user buffers are not registered",
    "--create-all-gather-group": "no separate all-gather process group is created",
    "--no-use-layer-wise-param-layout": "MatrixFSDP places whole matrices on owners (no layer-wise layout to opt "
    "out of)",
    "--high-priority-stream-groups": "CUDA stream priorities are not set",
    "--pipeline-model-parallel-comm-backend": "pipeline sends and receives use the distributed backend",
    "--use-ring-exchange-p2p": "pipeline sends and receives use batched isend/irecv",
    "--distributed-timeout-seconds-after-init": "--distributed-timeout-minutes applies throughout the run",
    "--flight-recorder-dump-path": "the NCCL flight recorder is not configured (set TORCH_NCCL_* yourself)",
    "--flight-recorder-trace-buffer-size": "the NCCL flight recorder is not configured (set TORCH_NCCL_* yourself)",
    "--flight-recorder-include-stack-trace": "the NCCL flight recorder is not configured (set TORCH_NCCL_* yourself)",
    "--no-flight-recorder-dump-on-timeout": "the NCCL flight recorder is not configured",
    "--disable-flight-recorder-dump-on-timeout": "the NCCL flight recorder is not configured",
    "--no-flight-recorder-include-only-active": "the NCCL flight recorder is not configured",
    "--disable-flight-recorder-include-only-active": "the NCCL flight recorder is not configured",
    "--no-flight-recorder-extra-dump-on-exec": "the NCCL flight recorder is not configured",
    "--disable-flight-recorder-extra-dump-on-exec": "the NCCL flight recorder is not configured",
    "--ddp-num-buckets": "megatron-core's DDP buckets follow --ddp-bucket-size; MatrixFSDP reduces per unit",
    "--ddp-pad-buckets-for-high-nccl-busbw": "buckets are not padded for NCCL bus bandwidth",
    "--ddp-reduce-scatter-with-fp32-accumulation": "gradients are reduced in the wire dtype; MatrixFSDP's owners "
    "accumulate in fp32 (--mfsdp-reduce-order)",
    "--ddp-param-name-patterns-for-fp32-local-accumulation": "gradients accumulate in the main-gradient dtype "
    "(--accumulate-allreduce-grads-in-fp32)",
    "--no-gradient-reduce-div-fusion": "the division by the data-parallel size is applied as megatron-core does",
    "--log-energy": "energy monitoring needs NVML: not logged",
    "--log-straggler": _STRAGGLER,
    "--straggler-minmax-count": _STRAGGLER,
    "--straggler-ctrlr-port": _STRAGGLER,
    "--disable-straggler-on-startup": _STRAGGLER,
    "--log-device-memory-used": "device memory as nvidia-smi reports it is not logged (the start-up memory lines "
    "and --log-memory-to-tensorboard report PyTorch's allocator)",
    "--log-memory-interval": "memory is reported at start-up, and every --tensorboard-log-interval with "
    "--log-memory-to-tensorboard",
    "--train-sync-interval": "every iteration synchronizes (its loss is read on the host): the host never runs ahead",
    "--gpu-sniff-test-interval": "GPU sniff tests are not run",
    "--exit-signal-handler-for-dataloader": "DataLoader workers keep Python's default signal handling",
    "--exit-signal-handler-for-training": "no graceful-shutdown handler is installed: SIGINT and SIGTERM stop the run "
    "as Python does (--exit-signal-handler saves and exits after the iteration)",
    "--no-pin-cpu-grads": "applies to optimizer offloading to the host, which megatron-mfsdp does not have",
    "--no-pin-cpu-params": "applies to optimizer offloading to the host, which megatron-mfsdp does not have",
    "--dataloader-fast-cache-load": "the dataset index cache is read as megatron-core builds it",
    "--allow-ambiguous-pad-tokens": "pad tokens are masked as megatron-core's GPTDataset does by default",
    "--mid-level-dataset-surplus": "the blended datasets are built with megatron-core's default surplus (0.005)",
    "--record-memory-history": "the CUDA memory history is not recorded",
    "--memory-snapshot-path": "the CUDA memory history is not recorded: no snapshot is written",
    "--nvtx-ranges": "megatron-mfsdp's named ranges (profiling.py) are always emitted on CUDA; Megatron-LM's own are "
    "not",
    "--record-shapes": "nsys mode (--profile) always records shapes (emit_nvtx(record_shapes=True))",
    "--pytorch-profiler-collect-shapes": "the PyTorch profiler here always records shapes and call stacks",
    "--pytorch-profiler-collect-callstack": "the PyTorch profiler here always records shapes and call stacks",
    "--pytorch-profiler-collect-chakra": "no Chakra execution trace is written (the chrome trace only)",
    "--dataloader-defer-npy-index-mmap": "the dataset indexes are memory-mapped when the datasets are built",
    "--enable-experimental": "no experimental feature is gated by it here",
    "--onnx-safe": "no ONNX export here",
    "--config-logger-dir": "layer configs and inputs are not dumped",
    "--init-model-with-meta-device": "weights are initialized on the host (--use-cpu-initialization) or the device",
    "--no-initialization": "weights are initialized, then overwritten by --load",
    "--te-rng-tracker": "megatron-core's CUDA RNG tracker runs (Transformer Engine's is for CUDA graphs)",
    "--inference-rng-tracker": "megatron-core's CUDA RNG tracker runs (the inference one is for inference)",
    "--fp16-lm-cross-entropy": "the cross entropy is computed in fp32",
    "--output-logit-dtype": "the output layer computes in the model's dtype (a separate dtype needs Transformer "
    "Engine's general_gemm)",
    "--reuse-grad-buf-for-mxfp8-param-ag": "MXFP8 parameters are gathered from their owners' own buffers",
    "--fp8-output-proj": "Transformer Engine's FP8 GEMM option: this run's FP8, if any, is the owners' parameter "
    "quantization (--fp8-param-gather)",
    "--fp8-quantizer-factory": "Transformer Engine's FP8 GEMM option: this run's FP8, if any, is the owners' "
    "parameter quantization (--fp8-param-gather)",
    "--disable-fp8-wgrad": "Transformer Engine's FP8 GEMM option: weight gradients are computed in the compute dtype",
    "--no-fp8-wgrad": "Transformer Engine's FP8 GEMM option: weight gradients are computed in the compute dtype",
    "--fused-residual-rmsnorm": "Transformer Engine fusion: not applied",
    "--use-fused-weighted-squared-relu": "Transformer Engine fusion: not applied",
    "--use-te-activation-func": "Transformer Engine fusion: megatron-core's activation runs",
    "--use-transformer-engine-op-fuser": "Transformer Engine fusion: not applied",
    "--use-grouped-gemm-for-dense-mlp": "the dense MLP runs plain GEMMs",
    "--muon-use-syrk": "Triton's SYRK kernel is not used (on a CPU, --muon-ns-algorithm auto/gram computes the "
    "symmetric products by block rows)",
    "--chat-template": "pretraining does not format conversations",
    "--use-gigatoken": "the standard tokenizer runs",
    "--legacy-tokenizer": _TOKENIZER_PREPROCESS,
    "--tokenizer-sentencepiece-legacy": _TOKENIZER_PREPROCESS,
    "--tokenizer-hf-use-fast": _TOKENIZER_PREPROCESS,
    "--tokenizer-hf-no-use-fast": _TOKENIZER_PREPROCESS,
    "--tokenizer-hf-include-special-tokens": _TOKENIZER_PREPROCESS,
    "--tokenizer-hf-no-include-special-tokens": _TOKENIZER_PREPROCESS,
    "--tokenizer-metadata": _TOKENIZER_PREPROCESS,
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": _TOKENIZER_PREPROCESS,
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": _TOKENIZER_PREPROCESS,
    "--tiktoken-special-tokens": "TikTokenizer takes its special tokens from --tokenizer-special-tokens",
    "--no-scatter-gather-tensors-in-pipeline": "pipeline stages send whole activations (megatron-core 0.16's p2p)",
}

# Megatron-LM's deprecated flags that it still accepts as no-ops, with its own words (megatron/
# training/arguments.py: validate_args's prints at HEAD, else the flag's help at HEAD or core_v0.16.1).
DEPRECATED = {
    "--use-dist-ckpt": "--use-dist-ckpt is deprecated and has no effect. Use --ckpt-format to select the "
    "checkpoint format.",
    "--dist-ckpt-format": "--dist-ckpt-format is deprecated and has no effect. Use --ckpt-format to select the "
    "checkpoint format.",
    "--ckpt-fully-parallel-save": "--ckpt-fully-parallel-save flag is deprecated and has no effect. Use "
    "--no-ckpt-fully-parallel-save to disable parallel save.",
    "--use-mcore-models": "DEPRECATED. Use the implementation from megatron core.Now ignored and mcore models "
    "are the default.",
    "--no-async-tensor-model-parallel-allreduce": "NOTE: Deprecated. This flag is ignored.",
    "--disable-async-tensor-model-parallel-allreduce": "NOTE: Deprecated. This flag is ignored.",
    "--disable-msc": "[DEPRECATED] MSC is disabled by default; this flag is a no-op and will be removed in a "
    "future release.",
    "--fp8-interval": "DEPRECATED from TransformerEngine v1.8.0. This flag is ignored.",
    "--disable-tp-comm-split-ag": "Deprecated from TransformerEngine v1.6.0 (and TP communication is not "
    "overlapped here).",
    "--disable-tp-comm-split-rs": "Deprecated from TransformerEngine v1.6.0 (and TP communication is not "
    "overlapped here).",
    "--no-tp-comm-split-ag": "Deprecated from TransformerEngine v1.6.0 (and TP communication is not overlapped here).",
    "--no-tp-comm-split-rs": "Deprecated from TransformerEngine v1.6.0 (and TP communication is not overlapped here).",
    "--no-weight-decay-cond-type": "WARNING: --no-weight-decay-cond-type is deprecated. Please use "
    "--apply-wd-to-qk-layernorm instead. (Its value apply_wd_to_qk_layernorm sets --apply-wd-to-qk-layernorm, "
    "as Megatron-LM.)",
}

NOTICES = {**NOT_APPLICABLE, **DEPRECATED}


@functools.cache
def megatron_lm_groups() -> dict:
    """Every Megatron-LM flag (megatron_lm_flags.txt) -> its Megatron-LM argument group title."""
    text = resources.files(__package__).joinpath("megatron_lm_flags.txt").read_text()
    rows = (line.split("\t") for line in text.splitlines() if line.startswith("--"))
    return {row[0]: row[1] if len(row) > 1 else "" for row in rows}


def megatron_lm_flags() -> frozenset:
    return frozenset(megatron_lm_groups())


def refusal(flag: str) -> str | None:
    """Why a Megatron-LM flag that pretrain_gpt.py does not implement is refused (None: no table names it)."""
    return refused.reason(flag, megatron_lm_groups().get(flag))


def unsupported_names(known) -> dict:
    """flag -> feature for the flags refused by feature (refused.FEATURES), over the names ``known``."""
    out = {}
    for feature, patterns in refused.FEATURES.items():
        for pattern in patterns:
            names = [n for n in known if n.startswith(pattern[:-1])] if pattern.endswith("*") else [pattern]
            out.update({n: feature for n in names})
    return out


def add_accepted_args(p: argparse.ArgumentParser) -> None:
    """Register the noticed and refused flags the parser lacks, so that they parse with any value
    (check_accepted then notices or refuses them). Refused ones are hidden from --help."""
    taken = set(p._option_string_actions)
    groups = megatron_lm_groups()
    for flag in sorted(set(groups) | set(NOTICES) | set(refused.INFERENCE_SCRIPT_FLAGS)):
        if flag in taken:
            continue
        help_text = NOTICES.get(flag)
        if help_text is None:
            help_text = argparse.SUPPRESS
        p.add_argument(flag, nargs="*", default=None, dest=_dest(flag), metavar="VALUE", help=help_text)


def _dest(flag: str) -> str:
    return "accepted_" + flag.lstrip("-").replace("-", "_")


def check_accepted(args, argv_flags) -> list:
    """Notices for the noticed flags given; raise ValueError for a refused one."""
    notices = []
    for flag in argv_flags:
        if flag in NOTICES:
            notices.append(f"{flag}: {NOTICES[flag]}")
            if flag == "--no-weight-decay-cond-type":
                args.apply_wd_to_qk_layernorm = True
            continue
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue  # implemented by pretrain_gpt.py's own parser
        if refused.harmless(flag, value, args):
            continue
        why = refusal(flag) or "a Megatron-LM flag that megatron-mfsdp does not support yet"
        raise ValueError(f"{flag}: {why}")
    return notices


def suggestions(flag: str, parser=None) -> list:
    """The known flags closest to ``flag`` (difflib), ours and Megatron-LM's."""
    known = set(megatron_lm_flags()) | set(NOTICES)
    if parser is not None:
        known |= {f for f in parser._option_string_actions if f.startswith("--")}
    return difflib.get_close_matches(flag, sorted(known), n=3, cutoff=0.75)


def explain_unrecognized(extra, parser=None) -> str:
    """The error for arguments the parser does not know, with the closest known flag names."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
    hints = [f"{f}: did you mean {' or '.join(close)}?" for f in flags if (close := suggestions(f, parser))]
    message = f"unrecognized arguments: {' '.join(extra)} (not Megatron-LM flags either; see --help)"
    return message + ("; " + "; ".join(hints) if hints else "")
