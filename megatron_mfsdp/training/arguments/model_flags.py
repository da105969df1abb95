"""Megatron-LM's model flags: names, dests and defaults as in megatron/training/arguments.py at
core_v0.16.1 (network size, transformer configuration, initialization, mixed precision and
FP8, mixture of experts). tests/unit/test_arguments.py holds Megatron-LM's defaults and compares."""

from __future__ import annotations

import argparse

from .types import (
    attention_backend,
    finite_float,
    fraction,
    layer_pattern,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
)


def _add_position_args(g) -> None:
    g.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "yarn", "mrope", "relative", "none"],  # Megatron-LM HEAD's
    )
    g.add_argument(
        "--use-rotary-position-embeddings", action="store_true", help="deprecated: --position-embedding-type rope"
    )
    g.add_argument("--rotary-base", type=positive_int, default=10000)
    g.add_argument("--rotary-percent", type=fraction, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=positive_int, default=None)
    g.add_argument("--use-rope-scaling", action="store_true", help="llama3.x rope scaling")
    _add_yarn_args(g)
    g.add_argument("--rope-scaling-factor", type=positive_float, default=8.0)
    g.add_argument(
        "--no-position-embedding",
        action="store_false",
        dest="add_position_embedding",
        help="deprecated: use --position-embedding-type",
    )


def _add_implementation_args(g) -> None:
    g.add_argument(
        "--transformer-impl",
        default="transformer_engine",
        choices=["local", "transformer_engine", "inference_optimized"],
        help="transformer_engine needs CUDA and Transformer Engine; elsewhere the local spec runs",
    )
    g.add_argument(
        "--attention-backend",
        type=attention_backend,
        default="auto",
        help="flash, fused, unfused, local or auto (Transformer Engine); the local spec uses PyTorch SDPA",
    )
    g.add_argument(
        "--use-mcore-models",
        dest="deprecated_use_mcore_models",
        action="store_true",
        help="accepted and ignored, as in Megatron-LM: megatron-core models are the only models",
    )


def add_network_size_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=positive_int, default=None)
    g.add_argument("--hidden-size", type=positive_int, default=None)
    g.add_argument(
        "--ffn-hidden-size",
        type=positive_int,
        default=None,
        help="default: 4 x hidden size, or int(8/3 x hidden / 64) x 64 with --swiglu (Megatron-LM's rule)",
    )
    g.add_argument("--num-attention-heads", type=positive_int, default=None)
    g.add_argument("--kv-channels", type=positive_int, default=None, help="default: hidden size / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=positive_int, default=1)
    g.add_argument("--max-position-embeddings", type=positive_int, default=None)
    _add_position_args(g)
    g.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="pad the vocabulary to a multiple of this value times the TP size (Megatron-LM's rule)",
    )
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=positive_float, default=1e-5)
    g.add_argument(
        "--apply-layernorm-1p",
        dest="layernorm_zero_centered_gamma",
        action="store_true",
        help="norm weights centered at zero: y = norm(x) * (1 + w) + b",
    )
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument(
        "--qk-clip",
        action="store_true",
        help="MuonClip: after each step, scale the query and key rows of every query group whose largest "
        "attention logit passed --qk-clip-threshold (megatron-core's rule; on MatrixFSDP the owner of each "
        "linear_qkv scales its fp32 master)",
    )
    g.add_argument("--qk-clip-alpha", type=float, default=0.5, help="queries x eta^alpha, keys x eta^(1 - alpha)")
    g.add_argument("--qk-clip-threshold", type=float, default=100.0, help="eta = min(1, threshold / max logit)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true", help="tanh-approximated GELU (GPT-2's)")
    g.add_argument("--squared-relu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=probability, default=0.1)
    g.add_argument("--attention-dropout", type=probability, default=0.1)
    g.add_argument(
        "--apply-query-key-layer-scaling",
        action="store_true",
        help="scale Q.K^T by 1/layer number (implies --attention-softmax-in-fp32)",
    )
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--fp32-residual-connection", action="store_true")
    _add_implementation_args(g)
    _add_mla_args(g)


def _add_yarn_args(g) -> None:
    """Megatron-LM HEAD's --yarn-* flags (megatron/training/arguments.py; argument_utils.py
    _apply_yarn_config_from_args), with its defaults (None: YarnRotaryEmbedding's). HEAD applies them to
    standard attention's --position-embedding-type yarn only and leaves MLA at MLATransformerConfig's
    original_max_position_embeddings, beta_fast and beta_slow, settable from no flag; here they set those (so
    Kimi K2's beta_fast 1 can be trained), and standard attention's YaRN stays refused."""
    g.add_argument(
        "--yarn-original-max-position-embeddings",
        type=positive_int,
        default=None,
        help="YaRN's original context length, for MLA's rotary part (default 4096)",
    )
    g.add_argument("--yarn-beta-fast", type=positive_float, default=None, help="YaRN's beta_fast (default 32)")
    g.add_argument("--yarn-beta-slow", type=positive_float, default=None, help="YaRN's beta_slow (default 1)")
    g.add_argument(
        "--yarn-correction-range-round-to-int",
        action="store_true",
        default=None,
        help="round YaRN's correction range to integers (megatron-core 0.16.1's MLA always does)",
    )
    g.add_argument(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest="yarn_correction_range_round_to_int",
        help="refused with MLA: megatron-core 0.16.1's MLASelfAttention always rounds",
    )


def _add_mla_args(g) -> None:
    """Multi-latent attention (megatron-core's MLASelfAttention): --multi-latent-attention is a TransformerConfig
    field, the rest Megatron-LM's "mla" group (_add_mla_args at core_v0.16.1), with its defaults; --rope-type
    None lets the config choose (MLATransformerConfig: yarn)."""
    g.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="megatron-core's multi-latent attention (MLATransformerConfig, MLASelfAttention): low-rank query and "
        "key/value projections, a decoupled shared rotary key",
    )
    g.add_argument("--q-lora-rank", type=positive_int, default=None, help="query's low rank (None: one linear_q_proj)")
    g.add_argument("--kv-lora-rank", type=positive_int, default=32, help="key and value's low rank")
    g.add_argument(
        "--qk-head-dim",
        type=positive_int,
        default=128,
        help="query/key head dim without position; each head's q/k dim is this + --qk-pos-emb-head-dim",
    )
    g.add_argument("--qk-pos-emb-head-dim", type=positive_int, default=64, help="query/key rotary part per head")
    g.add_argument("--v-head-dim", type=positive_int, default=128, help="value head dim")
    g.add_argument(
        "--rotary-scaling-factor", type=positive_float, default=1.0, help="YaRN scaling factor of MLA's rotary part"
    )
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale of MLA's rotary part")
    g.add_argument(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN mscale over all dims: MLA's softmax scale is mscale(factor, this)^2 / sqrt(q/k head dim)",
    )
    g.add_argument(
        "--rope-type",
        default=None,
        choices=["rope", "yarn"],
        help="MLA's RoPE (default: yarn, MLATransformerConfig's); standard attention runs rope only",
    )


def add_initialization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=nonnegative_int, default=1234)
    g.add_argument("--init-method-std", type=positive_float, default=0.02)
    g.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        default=None,
        help="always on without CUDA; with it, every layout starts from the 1 x 1 x 1 weights",
    )


def add_fusion_args(p: argparse.ArgumentParser) -> None:
    """Kernel fusions: honoured where megatron-core supports them on this device, else a notice."""
    g = p.add_argument_group("fusions")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--disable-jit-fuser", action="store_true", help="run megatron-core's fused functions uncompiled")
    g.add_argument("--recompute-activations", action="store_true", help="selective recomputation (core attention)")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=positive_int, default=None)
    g.add_argument(
        "--recompute-modules",
        nargs="+",
        default=None,
        help="with selective recomputation: the parts of each layer to recompute in backward, of core_attn "
        "(megatron-core's default), layernorm and mlp (the others are MoE's, MLA's and hybrid layers')",
    )
    g.add_argument(
        "--distribute-saved-activations",
        action="store_true",
        help="with full recomputation: split each saved layer input over the TP ranks",
    )
    g.add_argument(
        "--no-clone-scatter-output-in-embedding",
        "--disable-clone-scatter-output-in-embedding",
        dest="clone_scatter_output_in_embedding",
        action="store_false",
        help="with --sequence-parallel: do not clone the embedding's scattered output (saves its memory)",
    )


def add_mixed_precision_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=positive_float, default=None, help="static loss scale; default: dynamic")
    g.add_argument("--initial-loss-scale", type=positive_float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=positive_float, default=1.0)
    g.add_argument("--loss-scale-window", type=positive_float, default=1000)
    g.add_argument("--hysteresis", type=positive_int, default=2)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="with --bf16: no reduced-precision reductions in cuBLAS bf16 GEMMs (megatron-core sets torch's flag)",
    )
    g = p.add_argument_group("FP8")
    g.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"])
    g.add_argument("--fp8-recipe", default="delayed", choices=["tensorwise", "delayed", "mxfp8", "blockwise"])
    g.add_argument("--fp8-margin", type=nonnegative_int, default=0)
    g.add_argument("--fp8-amax-history-len", type=positive_int, default=1)
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"])
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument("--first-last-layers-bf16", action="store_true")
    g.add_argument("--num-layers-at-start-in-bf16", type=nonnegative_int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=nonnegative_int, default=1)


def add_regularization_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regularization")
    g.add_argument("--weight-decay", type=finite_float, default=0.01)
    g.add_argument("--start-weight-decay", type=finite_float, default=None)
    g.add_argument("--end-weight-decay", type=finite_float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true")
    g.add_argument("--clip-grad", type=nonnegative_float, default=1.0, help="global L2 norm clip; 0 disables")
    g.add_argument("--adam-beta1", type=probability, default=0.9)
    g.add_argument("--adam-beta2", type=probability, default=0.999)
    g.add_argument("--adam-eps", type=positive_float, default=1e-8)
    g.add_argument("--sgd-momentum", type=probability, default=0.9)


LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """Mixture of experts: megatron-core's MoE layer (router, token dispatcher, experts). Megatron-LM's
    _add_moe_args at core_v0.16.1 for --num-experts, --moe-layer-freq and the load balancing; the rest are
    TransformerConfig fields that its parser builds from the dataclass (names, dests and defaults as
    there). megatron-core reads each from the TransformerConfig (models/gpt/config.py)."""
    g = p.add_argument_group("moe")
    g.add_argument("--num-experts", type=nonnegative_int, default=None, help="experts per MoE layer (0 or none: dense)")
    g.add_argument(
        "--moe-layer-freq",
        type=layer_pattern,
        default=1,
        help="an integer N: one MoE layer every N layers (the first is one); or a pattern such as "
        '"([0]+[1]*3)" (1 MoE, 0 dense), one entry per layer',
    )
    g.add_argument(
        "--moe-ffn-hidden-size",
        type=positive_int,
        default=None,
        help="each expert's FFN size; default --ffn-hidden-size",
    )
    g.add_argument(
        "--moe-shared-expert-intermediate-size",
        type=positive_int,
        default=None,
        help="FFN size of the shared experts (all of them together); none: no shared expert",
    )
    g.add_argument("--moe-shared-expert-gate", action="store_true", help="a sigmoid gate on the shared experts' output")
    g.add_argument(
        "--moe-shared-expert-overlap",
        action="store_true",
        help="with the alltoall dispatcher on CUDA: run the shared experts beside the dispatch",
    )
    _add_moe_router_args(g)
    _add_moe_dispatch_args(g)
    _add_moe_kernel_and_parallel_args(g)


def _add_moe_router_args(g) -> None:
    """The router: scores, top-k, group-limited routing, load balancing and the expert bias."""
    g.add_argument(
        "--moe-router-load-balancing-type",
        nargs="+",
        choices=LOAD_BALANCING_TYPES,
        default="aux_loss",
        help="aux_loss (GShard/Switch, per micro-batch), seq_aux_loss (per sequence, DeepSeek), "
        "global_aux_loss (per global batch), sinkhorn or none; several combine",
    )
    g.add_argument(
        "--moe-aux-loss-coeff",
        type=nonnegative_float,
        nargs="+",
        default=0.0,
        help="coefficient of each load-balancing loss (1e-2 is a start)",
    )
    g.add_argument(
        "--moe-z-loss-coeff",
        type=nonnegative_float,
        default=None,
        help="coefficient of the router z-loss (1e-3 is a start)",
    )
    g.add_argument("--moe-router-topk", type=positive_int, default=2, help="experts each token is routed to")
    g.add_argument(
        "--moe-router-score-function",
        default="softmax",
        choices=["softmax", "sigmoid"],
        help="the routing scores: softmax or sigmoid (DeepSeek-V3's, needed by the expert bias)",
    )
    g.add_argument(
        "--moe-router-pre-softmax",
        action="store_true",
        help="scores (softmax or sigmoid) before the top-k selection (needed for top-1 softmax)",
    )
    g.add_argument(
        "--moe-router-topk-scaling-factor",
        type=positive_float,
        default=None,
        help="scale of the top-k routing scores (with --moe-router-pre-softmax)",
    )
    _add_moe_group_and_bias_args(g)


def _add_moe_group_and_bias_args(g) -> None:
    """Group-limited routing, the aux-loss-free expert bias and the router's precision."""
    g.add_argument(
        "--moe-router-num-groups",
        type=positive_int,
        default=None,
        help="group-limited routing: the experts form this many groups (e.g. the EP size)",
    )
    g.add_argument(
        "--moe-router-group-topk",
        type=positive_int,
        default=None,
        help="group-limited routing: the groups each token may use",
    )
    g.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="aux-loss-free balancing: a per-expert bias on the routing scores, updated from the global "
        "batch's token counts (needs --moe-router-score-function sigmoid)",
    )
    g.add_argument(
        "--moe-router-bias-update-rate",
        type=nonnegative_float,
        default=1e-3,
        help="the expert bias's step per global batch",
    )
    g.add_argument(
        "--moe-router-dtype",
        default=None,
        choices=["fp32", "fp64"],
        help="dtype of the routing and of the weighted sum of the experts' outputs",
    )
    g.add_argument(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="benchmarks only: random router logits, so the experts are loaded evenly",
    )


def _add_moe_dispatch_args(g) -> None:
    """The token dispatcher, capacity and token dropping, and MoE logging."""
    g.add_argument(
        "--moe-input-jitter-eps",
        type=nonnegative_float,
        default=None,
        help="multiply the router input by uniform noise in [1 - eps, 1 + eps] while training",
    )
    g.add_argument(
        "--moe-token-dispatcher-type",
        default="allgather",
        choices=["allgather", "alltoall", "flex"],
        help="allgather or alltoall (flex, DeepEP's, is refused)",
    )
    g.add_argument(
        "--moe-expert-capacity-factor",
        type=finite_float,
        default=None,
        help="each expert takes at most this factor x its even share of the tokens; none: no token is dropped",
    )
    g.add_argument(
        "--moe-pad-expert-input-to-capacity",
        action="store_true",
        help="with a capacity factor: pad each expert's input to its capacity",
    )
    g.add_argument(
        "--moe-token-drop-policy",
        default="probs",
        choices=["probs", "position"],
        help="over capacity, drop the lowest-probability tokens (probs) or the last ones (position)",
    )
    g.add_argument(
        "--moe-apply-probs-on-input",
        action="store_true",
        help="weight the expert's input by its routing probability instead of its output (top-1)",
    )
    g.add_argument(
        "--moe-per-layer-logging",
        action="store_true",
        help="also write each MoE layer's auxiliary losses to TensorBoard/W&B",
    )


def _add_moe_kernel_and_parallel_args(g) -> None:
    """CUDA kernels (grouped GEMM, fusions) and expert parallelism."""
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="TEGroupedMLP (Transformer Engine on CUDA); elsewhere SequentialMLP runs, with a notice",
    )
    g.add_argument("--moe-permute-fusion", action="store_true", help="Transformer Engine's fused token permutation")
    g.add_argument("--moe-router-fusion", action="store_true", help="Transformer Engine's fused top-k and aux loss")
    g.add_argument(
        "--expert-model-parallel-size",
        type=positive_int,
        default=1,
        help="expert parallelism: each rank holds --num-experts / this many experts",
    )
    g.add_argument(
        "--expert-tensor-parallel-size",
        type=positive_int,
        default=None,
        help="tensor parallelism inside each expert; default --tensor-model-parallel-size",
    )
