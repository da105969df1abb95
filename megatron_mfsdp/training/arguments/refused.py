"""Megatron-LM flags refused before any work, each with its reason.

A flag is refused by its feature (``FEATURES``: names and ``--prefix-*`` patterns), by its own sentence
(``REASONS``: Megatron-LM's own refusals quoted, and flags whose effect we cannot give), or by its
Megatron-LM argument group when the whole group is one feature (``GROUPS``: megatron_lm_flags.txt gives
each flag's group), or as a flag of Megatron-LM's inference scripts (``INFERENCE_SCRIPT_FLAGS``). Values at
which a refused flag changes nothing (``HARMLESS``) parse. A flag that pretrain_gpt.py implements is never
refused, whatever these tables say (the lists cover Megatron-LM's flags; update rules registered later may
implement some, e.g. --lion-beta1).
tests/unit/test_megatron_flag_coverage.py holds every flag of Megatron-LM HEAD to exactly one of
implemented, noticed (accepted.py) or refused here.
"""

from __future__ import annotations

FEATURES = {
    "MoE upcycling (a dense checkpoint turned into experts)": ("--moe-use-upcycling", "--moe-upcycling-granularity"),
    "the flex token dispatcher (DeepEP, HybridEP and NCCL EP kernels, CUDA only; allgather and alltoall run)": (
        "--moe-enable-deepep",
        "--moe-flex-dispatcher-*",
        "--moe-deepep-num-sms",
        "--moe-hybridep-*",
        "--moe-permute-fusion-into-hybridep",
        "--moe-ncclep-zero-copy",
    ),
    "overlapping the MoE expert-parallel all-to-all with computation": (
        "--overlap-moe-expert-parallel-comm",
        "--ep-overlap-early-attn-memory-release",
        "--overlap-dispatch-backward-with-experts-wgrad",
        "--high-priority-a2a-comm-stream",
    ),
    "low-precision MoE dispatch and combine": ("--moe-dispatch-fwd-dtype", "--moe-combine-bwd-dtype"),
    "MoE routing replay and routing traces": ("--moe-enable-routing-replay", "--moe-routing-trace-*"),
    "MoE latent projections": ("--moe-latent-size",),
    "paged stashing of MoE activations": ("--moe-paged-stash*",),
    "router padding for quantized (FP8/FP4) grouped GEMMs": (
        "--moe-router-padding-for-fp8",
        "--moe-router-padding-for-quantization",
    ),
    "grouped expert weight layouts other than one weight per expert (single grouped weights, grouped tensors, "
    "interleaved GLU halves, grouped GEMM for shared experts)": (
        "--moe-single-grouped-weight",
        "--moe-single-grouped-bias",
        "--moe-use-grouped-tensor",
        "--moe-mlp-glu-interleave-size",
        "--moe-shared-expert-glu-interleave-size",
        "--use-grouped-gemm-for-shared-expert",
    ),
    "router options newer than megatron-core 0.16.1 (forced bias, quantile balancing, per-rank capacity)": (
        "--moe-router-force-biased",
        "--moe-router-quantile-balancing-ema",
        "--moe-expert-rank-capacity-factor",
    ),
    "recomputing MoE layers (--moe-layer-recompute)": ("--moe-layer-recompute",),
    "context parallelism": (
        "--context-parallel-size",
        "--cp-comm-type",
        "--hierarchical-context-parallel-sizes",
        "--hybrid-context-parallel",
        "--max-seqlen-per-dp-cp-rank",
    ),
    "experimental attention variants (gated delta net, DSA, linear attention)": (
        "--experimental-attention-variant",
        "--linear-*",
        "--dsa-*",
        "--disable-dsa-*",
        "--no-dsa-*",
        "--gdp-*",
    ),
    # standard attention with a gate per head: linear_qkv grows, the output is scaled by sigmoid(gate)
    # (megatron/core/transformer/attention.py at core_v0.16.1); its QKV layout would need its own split
    "the attention output gate (gated attention)": ("--attention-output-gate",),
    "Mamba and hybrid models": (
        "--mamba-*",
        "--disable-mamba-mem-eff-path",
        "--is-hybrid-model",
        "--hybrid-layer-pattern",
        "--hybrid-override-pattern",
        "--hybrid-attention-ratio",
        "--hybrid-mlp-ratio",
    ),
    "multi-token prediction": ("--mtp-*",),
    "hyper-connections (mHC)": ("--enable-mhc-connections", "--mhc-*"),
    "muP": ("--use-mup", "--mup-*"),
    "FIM datasets": ("--fim-*",),
    "Megatron-FSDP and torch FSDP2 (use --use-matrix-fsdp, owner-sharded ZeRO-3)": (
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        "--torch-fsdp2-no-reshard-after-forward",
        "--data-parallel-sharding-strategy",
        "--outer-dp-sharding-strategy",
        "--enable-full-sharding-in-hsdp",
        "--megatron-fsdp-*",
        "--fsdp-*",
        "--suggested-communication-unit-size",
        "--keep-fp8-transpose-cache",
        "--no-strict-fsdp-dtensor-load",
        "--disable-strict-fsdp-dtensor-load",
    ),
    "ModelOpt quantization, export and distillation": ("--export-*",),
    "inference-only kernels and options": (
        "--flash-decode",
        "--inference-disable-triton-nvls-kernels",
        "--inference-fuse-tp-communication",
        "--inference-grouped-gemm-backend",
        "--inference-moe-*",
        "--mlp-chunks-for-prefill",
        "--nccl-all-reduce-for-prefill",
    ),
    "CUDA graphs": (
        "--cuda-graph-*",
        "--enable-cuda-graph",
        "--external-cuda-graph",
        "--delay-offload-until-cuda-graph",
        "--optimizer-cuda-graph",
        "--inference-cuda-graph-scope",
        "--moe-pad-experts-for-cuda-graph-inference",
    ),
    "activation offloading to the host": (
        "--activation-offload-fraction",
        "--cpu-offloading-num-layers",
        "--cpu-offloading-retain-pinned-cpu-buffers",
        "--fine-grained-activation-offloading",
        "--fine-grained-offloading-max-inflight-offloads",
        "--min-offloaded-tensor-size",
        "--offload-modules",
        "--delta-offload-bytes-across-pp-ranks",
    ),
    "optimizer offloading to the host": (
        "--optimizer-cpu-offload",
        "--optimizer-offload-fraction",
        "--use-torch-optimizer-for-cpu-offload",
        "--overlap-cpu-optimizer-d2h-h2d",
    ),
    "FP4": ("--fp4-*",),
    "Transformer Engine's precision-aware optimizer (low-precision main parameters and moments)": (
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "--main-params-dtype",
        "--exp-avg-dtype",
        "--exp-avg-sq-dtype",
    ),
    "generalized tensor parallelism (GTP weight rematerialization)": (
        "--gtp-*",
        "--tensor-parallel-num-weight-shards",
        "--expert-tensor-parallel-num-weight-shards",
    ),
    "batch-invariant kernels": ("--batch-invariant-mode", "--batch-invariant-backend"),
    "sliding-window attention": ("--window-size", "--window-attn-skip-freq"),
    "relative position embeddings (T5)": ("--relative-attention-num-buckets", "--relative-attention-max-distance"),
    "encoder-decoder and BERT models": (
        "--encoder-num-layers",
        "--decoder-num-layers",
        "--encoder-seq-length",
        "--decoder-seq-length",
        "--bert-no-binary-head",
        "--mask-prob",
        "--short-seq-prob",
        "--sample-rate",
    ),
    "QK L2 normalization": ("--qk-l2-norm",),
    "NVIDIA Kitchen quantization": ("--use-kitchen-attention", "--kitchen-*"),
    "non-persistent (local, in-memory) checkpoints and their replication": (
        "--non-persistent-*",
        "--replication",
        "--replication-factor",
        "--replication-jump",
    ),
    "debug dumps of parameters, activations and gradients": (
        "--save-params-interval",
        "--save-activations-interval",
        "--save-tokens-per-expert-interval",
        "--save-wgrads-interval",
        "--save-dgrads-interval",
    ),
    "multiple validation sets": ("--multiple-validation-sets", "--validation-set-names", "--full-validation"),
    "GPT-OSS activations (clamped, offset GLU)": ("--activation-func-clamp-value", "--glu-linear-offset"),
    "the Megatron-LM legacy (non-megatron-core) models": ("--use-legacy-models",),
}

# Megatron-LM argument groups that are one feature megatron-mfsdp does not have.
GROUPS = {
    "rl": "reinforcement learning (Megatron-LM's GRPO trainer)",
    "inference": "Megatron-LM's inference engine and text-generation server",
    "vision": "vision models",
    "biencoder": "the BERT biencoder/ICT retriever",
    "In-process restart": "in-process restart (nvidia-resiliency-ext)",
    "one logger": "NVIDIA one-logger telemetry",
    "ft_package": "fault tolerance (nvidia-resiliency-ext's ft_launcher)",
    "fault injector": "the fault injector",
    "opentelemetry": "OpenTelemetry tracing",
    "msc": "the Multi-Storage Client",
    "sft": "supervised fine-tuning (SFT) datasets",
    "Logits Distillation": "logits distillation",
    "heterogeneous architecture": "heterogeneous layer configurations",
    "autoresume": "ADLR autoresume",
    "workload inspector": "the workload inspector server",
    "mla": "multi-latent attention options newer than megatron-core 0.16.1",
    "experimental_attention_variant": "experimental attention variants",
    "modelopt-generic": "ModelOpt quantization, export and distillation",
    "kitchen": "NVIDIA Kitchen quantization",
}

# Flags refused with their own sentence: Megatron-LM's own refusals (validate_args at HEAD asserts or
# exits on these, megatron/training/arguments.py), and flags whose effect megatron-mfsdp cannot give.
REASONS = {
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead (as Megatron-LM)",
    "--warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead (as Megatron-LM)",
    "--model-parallel-size": "--model-parallel-size is no longer valid, use --tensor-model-parallel-size instead "
    "(as Megatron-LM)",
    "--checkpoint-activations": "--checkpoint-activations is no longer valid, use --recompute-activations, or, for "
    "more control, --recompute-granularity and --recompute-method (as Megatron-LM)",
    "--yaml-cfg": "YAML configs are not read: give the flags on the command line",
    "--spec": "custom layer specs are not supported: megatron-core's GPT layer spec (local or Transformer Engine) runs",
    "--lazy-mpu-init": "lazy initialization (a caller completing the process groups) is not supported",
    "--fake-process-group": "the fake process group is not supported (tools/plan.py plans any world size on one host)",
    "--pipeline-model-parallel-layout": "custom pipeline layouts are not supported (use "
    "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)",
    "--data-parallel-random-init": "every data-parallel rank starts from the same weights (each weight has one owner)",
    "--init-method-xavier-uniform": "Xavier-uniform initialization is not supported yet (normal, --init-method-std)",
    "--embedding-init-method-std": "a separate embedding initialization is not supported yet (--init-method-std)",
    "--apply-residual-connection-post-layernorm": "the residual after the layernorm is not supported yet",
    "--quick-geglu": "the quick GeGLU activation is not supported yet (--swiglu, --squared-relu, --openai-gelu)",
    "--no-rope-freq": "skipping RoPE on some layers is not supported yet",
    "--mrope-section": "multimodal RoPE is not supported",
    "--mlp-chunks-for-training": "chunked MLPs are not supported yet",
    "--freeze-all-layers": "freezing layers is not supported yet",
    "--iterations-to-skip": "skipping iterations is not supported yet",
    "--decrease-batch-size-if-needed": "the global batch size is never changed: it must divide by micro batch x DP",
    "--dump-param-to-param-group-map": "parameter groups from a JSON map are not supported (--mfsdp-param-rule "
    "puts parameters under update rules)",
    "--ckpt-convert-format": "checkpoint conversion at load is not supported: use tools/checkpoint/convert.py",
    "--ckpt-convert-save": "checkpoint conversion at load is not supported: use tools/checkpoint/convert.py",
    "--ckpt-convert-update-legacy-dist-opt-format": "Megatron-LM's legacy distributed-optimizer checkpoints "
    "(before Feb 2024) are not read",
    "--override-ckpt-iteration": "the loaded iteration is the checkpoint's (or --finetune's 0)",
    "--load-main-params-from-ckpt": "main parameters come from the loaded optimizer state, or from the loaded "
    "weights without it (--no-load-optim)",
    "--per-dataset-sequences-path": "per-dataset sequence counts from a file are not supported yet",
    "--phase-transition-iterations": "data phase transitions are not supported yet",
    "--dataloader-inter-document-masking": "inter-document attention masking (cu_seqlens) is not supported yet",
    "--object-storage-cache-path": "datasets on object storage (S3, MSC) are not supported",
    "--padded-vocab-size": "the padded vocabulary is computed from the tokenizer and --make-vocab-size-divisible-by",
    "--no-pad-vocab-size": "the vocabulary is always padded (Megatron-LM's rule, --make-vocab-size-divisible-by)",
    "--disable-pad-vocab-size": "the vocabulary is always padded (Megatron-LM's rule, --make-vocab-size-divisible-by)",
    "--null-tokenizer-eod-id": "NullTokenizer's end-of-document id is its vocabulary size - 1 here",
    "--null-tokenizer-pad-id": "NullTokenizer has no pad token here",
    "--te-precision-config-file": "Transformer Engine per-module precision overrides are not supported",
    "--cache-mla-latents": "caching multi-latent attention's latents (absorbed up projections, Flash MLA) is "
    "for Megatron-LM's dynamic inference engine, which megatron-mfsdp does not have; training and tools/generate.py "
    "keep megatron-core's full key/value cache",
    "--mla-down-proj-fusion": "fusing multi-latent attention's query and key/value down projections into one linear "
    "is newer than megatron-core 0.16.1 (its MLASelfAttention has linear_q_down_proj and linear_kv_down_proj)",
    "--softmax-type": "attention sinks (softmax types other than vanilla) are not supported",
    "--use-legacy-static-engine": "Megatron-LM's inference engine is not part of megatron-mfsdp",
    "--moe-use-legacy-grouped-gemm": "megatron-core's legacy GroupedMLP is not supported: its weight1 concatenates "
    "the local experts in one 2D tensor, so a matrix optimizer cannot treat each expert as its own matrix "
    "(SequentialMLP runs, or TEGroupedMLP with --moe-grouped-gemm on Transformer Engine)",
    "--moe-extended-tp": "--moe-extended-tp is gone from Megatron-LM: use --expert-tensor-parallel-size",
}

# Flags that Megatron-LM's inference scripts add to its parser (megatron/inference/utils.py add_inference_args,
# examples/inference/advanced/gpt_static_inference.py and examples/inference/offline_inference.py at HEAD);
# Megatron-LM's inference functional-test configs give them. Refused by name like its own inference flags.
INFERENCE_SCRIPT_FLAGS = (
    "--temperature",
    "--top_k",
    "--top_p",
    "--return-log-probs",
    "--prompts",
    "--num-tokens-to-prompt",
    "--num-tokens-to-generate",
    "--num-tokens-from-file",
    "--top-n-logprobs",
    "--incoming-requests-per-step",
    "--incoming-requests-per-sec",
    "--incoming-requests-duration",
    "--model-provider",
    "--skip-prompt-log-probs",
    "--stop-words",
    "--output-path",
    "--output-every-n-results",
    "--output-request-events",
    "--prompt-file",
    "--prompt-file-num-truncate",
    "--use-flashinfer-fused-rope",
    "--no-record-throughput",
    "--inference-ckpt-non-strict",
    "--termination-id",
    "--suspend-resume-interval",
    "--suspend-timeout",
    "--inference-repeat-n",
    "--throughput-check-only",
    "--drain-between-batches",
    "--batch-boundaries",
    "--coordinator-schedule-output-path",
    "--moe-routing-trace-max-inference-steps",
    "--max-batch-size",
    "--stream",
    "--use-coordinator",
    "--coordinator-host",
    "--coordinator-port",
    "--async-mode",
)

# Values at which a refused flag changes nothing (Megatron-LM's defaults).
HARMLESS = {
    "--context-parallel-size": ["1"],
    "--softmax-type": ["vanilla"],
    "--cuda-graph-impl": ["none"],
    "--main-grads-dtype": ["fp32"],
    "--main-params-dtype": ["fp32"],
    "--exp-avg-dtype": ["fp32"],
    "--exp-avg-sq-dtype": ["fp32"],
}


def harmless(flag: str, value, args) -> bool:
    """Whether ``value`` (the accepted flag's words) of a refused flag changes nothing."""
    return flag in HARMLESS and value == HARMLESS[flag]


def _matches(flag: str, pattern: str) -> bool:
    return flag.startswith(pattern[:-1]) if pattern.endswith("*") else flag == pattern


def reason(flag: str, group: str | None) -> str | None:
    """Why ``flag`` (of Megatron-LM argument group ``group``) is refused; None when no table names it."""
    if flag in REASONS:
        return REASONS[flag]
    if flag in INFERENCE_SCRIPT_FLAGS:
        return f"a flag of Megatron-LM's inference scripts: {GROUPS['inference']} is not supported by megatron-mfsdp"
    for feature, patterns in FEATURES.items():
        if any(_matches(flag, p) for p in patterns):
            return f"{feature} is not supported by megatron-mfsdp yet"
    if group in GROUPS:
        return f"{GROUPS[group]} is not supported by megatron-mfsdp"
    return None
