"""Hugging Face checkpoints <-> megatron-core GPTModel: LlamaForCausalLM, GPT2LMHeadModel,
Qwen3MoeForCausalLM (mixture of experts, as megatron-core's MoE layer with SequentialMLP experts) and
DeepseekV3ForCausalLM (Moonlight's, Kimi K2's: multi-latent attention and MoE layers with a shared expert).

Our side is a state dict with the global (1 x 1 x 1, TP=1) parameter names of megatron-core's
GPTModel built from the local layer spec (build.py), e.g.
``decoder.layers.3.self_attention.linear_qkv.weight``, and ``model_args``: the model's settings
keyed by Megatron-LM argument dests (what ``args.<dest>`` holds in
megatron/training/arguments.py at core_v0.16.1), so a converted checkpoint means what the same
flags mean there. A setting one side cannot express is refused by name, never approximated.

Tensors that need no change are passed through: the result may share memory with the input.
"""

from __future__ import annotations

import json
import os
import re
from typing import NoReturn

import torch

# Megatron-LM's defaults (megatron/training/arguments.py at core_v0.16.1) for the dests read
# here; a model_args dict without one of them means the default, as on the command line.
MEGATRON_DEFAULTS = {
    "group_query_attention": False,
    "num_query_groups": 1,
    "kv_channels": None,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000,
    "rotary_percent": 1.0,
    "rotary_interleaved": False,
    "rotary_seq_len_interpolation_factor": None,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "normalization": "LayerNorm",
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,  # the dest of --apply-layernorm-1p
    "apply_residual_connection_post_layernorm": False,
    "qk_layernorm": False,
    "swiglu": False,
    "openai_gelu": False,
    "squared_relu": False,
    "quick_geglu": False,
    "add_bias_linear": True,  # --disable-bias-linear stores False
    "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False,
    "make_vocab_size_divisible_by": 128,
    "init_method_std": 0.02,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "num_experts": None,
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,  # None: ffn_hidden_size (Megatron-LM's validate_args)
    "moe_router_topk": 2,
    "moe_router_pre_softmax": False,
    "moe_router_score_function": "softmax",
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_expert_capacity_factor": None,
    "moe_apply_probs_on_input": False,
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rope_type": None,  # None: MLATransformerConfig's default, yarn
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "yarn_original_max_position_embeddings": None,  # None: MLATransformerConfig's 4096, beta_fast 32, beta_slow 1
    "yarn_beta_fast": None,
    "yarn_beta_slow": None,
    "mtp_num_layers": None,
    "vocab_size": None,
    "padded_vocab_size": None,
}
REQUIRED_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings")

# HF activations that are the tanh approximation of GELU, megatron's openai_gelu
# (megatron/core/transformer/utils.py: gelu_impl); plain "gelu" is the erf form, F.gelu.
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
# The fixed llama3 frequency bands of megatron-core's RotaryEmbedding._apply_scaling
# (megatron/core/models/common/embeddings/rotary_pos_embedding.py at core_v0.16.1).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Input tensors that are not parameters and carry nothing to convert.
IGNORED = {
    "llama": (r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq",),
    "qwen3_moe": (r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq",),
    "deepseek_v3": (r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq",),
    "gpt2": (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
    "megatron": (r".*\._extra_state",),
}


class ConversionError(ValueError):
    """A checkpoint or setting that cannot be converted faithfully; the message names it."""


def _refuse(setting: str, value, why: str) -> NoReturn:
    raise ConversionError(f"{setting}={value!r} cannot be converted: {why}")


# ----------------------------------------------------------------------------------------
# Tensor layouts
# ----------------------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """megatron's linear_qkv (weight or bias) from separate Q, K, V: per query group, that
    group's Q heads, then its K, then its V (the view in SelfAttention.get_query_key_value_tensors,
    megatron/core/transformer/attention.py at core_v0.16.1)."""
    tail = q.shape[1:]
    head_dim = k.shape[0] // num_query_groups
    blocks = [t.reshape(num_query_groups, -1, head_dim, *tail) for t in (q, k, v)]
    return torch.cat(blocks, dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int):
    """(Q, K, V) rows of megatron's grouped linear_qkv, the inverse of ``fuse_qkv``."""
    tail = qkv.shape[1:]
    per_group = num_attention_heads // num_query_groups
    blocks = qkv.reshape(num_query_groups, per_group + 2, head_dim, *tail)
    q = blocks[:, :per_group].reshape(-1, *tail)
    k = blocks[:, per_group].reshape(-1, *tail)
    v = blocks[:, per_group + 1].reshape(-1, *tail)
    return q.clone(), k.clone(), v.clone()


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """megatron's SwiGLU linear_fc1 from HF's gate_proj and up_proj: gate rows first (megatron-core's
    MLP splits fc1's output in two and applies the activation to the first half: bias_swiglu_impl /
    glu in megatron/core/transformer/mlp.py at core_v0.16.1)."""
    return torch.cat([gate, up])


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_proj, up_proj) of megatron's SwiGLU linear_fc1, the inverse of ``fuse_gate_up``."""
    gate, up = fc1.chunk(2)
    return gate.clone(), up.clone()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The embedding padded to megatron's padded vocabulary with zero rows."""
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


class _Tensors:
    """An input state dict consumed key by key: a missing key, or one nobody took, is an error
    (a checkpoint is never converted in part)."""

    def __init__(self, state_dict: dict, what: str, ignored: tuple[str, ...]):
        self.what = what
        self.left = {
            k: v
            for k, v in state_dict.items()
            if isinstance(v, torch.Tensor) and not any(re.fullmatch(p, k) for p in ignored)
        }

    def pop(self, key: str) -> torch.Tensor:
        if key not in self.left:
            raise ConversionError(f"{self.what}: tensor {key!r} is missing")
        return self.left.pop(key)

    def finish(self) -> None:
        if self.left:
            raise ConversionError(f"{self.what}: tensors with no counterpart: {sorted(self.left)}")


def _copy(src: _Tensors, dst: dict, table, to_megatron: bool) -> None:
    """Copy (ours, theirs, transposed) name pairs; transposed ones are GPT-2's Conv1D [in, out]."""
    for ours, theirs, transposed in table:
        tensor = src.pop(theirs if to_megatron else ours)
        dst[ours if to_megatron else theirs] = tensor.t().contiguous() if transposed else tensor


def _output_layer(src: _Tensors, dst: dict, model_args: dict, embedding: torch.Tensor, to_megatron: bool) -> None:
    """lm_head <-> output_layer when untied; a tied lm_head given anyway must equal the embedding."""
    ours, theirs = "output_layer.weight", "lm_head.weight"
    if model_args["untie_embeddings_and_output_weights"]:
        tensor = src.pop(theirs if to_megatron else ours)
        rows = model_args["padded_vocab_size"] if to_megatron else model_args["vocab_size"]
        dst[ours if to_megatron else theirs] = _pad_rows(tensor, rows) if to_megatron else tensor[:rows].clone()
        return
    given = src.left.pop(theirs if to_megatron else ours, None)
    if given is not None and not torch.equal(given[: embedding.shape[0]], embedding):
        raise ConversionError(f"{theirs if to_megatron else ours} differs from the embedding of a tied model")


# ----------------------------------------------------------------------------------------
# Settings: HF config -> model_args
# ----------------------------------------------------------------------------------------


def _as_config(hf_config):
    """A transformers config from a config object or a config.json dict."""
    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        fields = dict(hf_config)
        return AutoConfig.for_model(fields.pop("model_type", None), **fields)
    return hf_config


def _rope_settings(cfg) -> dict:
    """rotary dests of a Llama config, from transformers 5's rope_parameters or 4's
    rope_theta/rope_scaling; only the default and megatron's llama3 frequency bands convert."""
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    params.update(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        _refuse("partial_rotary_factor", partial, "LlamaForCausalLM rotates the whole head")
    if theta is None:
        _refuse("rope_theta", theta, "the rotary base is not set")
    settings = {"rotary_base": int(theta) if float(theta).is_integer() else float(theta), "rotary_percent": 1.0}
    settings.update(rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0)
    if rope_type == "llama3":
        for key, value in LLAMA3_ROPE.items():
            if float(params.get(key, -1)) != value:
                _refuse(f"rope_scaling.{key}", params.get(key), f"megatron's llama3 scaling fixes it to {value}")
        settings.update(use_rope_scaling=True, rope_scaling_factor=float(params["factor"]))
    elif rope_type != "default":
        _refuse("rope_scaling.rope_type", rope_type, "megatron-core's GPTModel has only default and llama3 RoPE")
    return settings


def _vocab_args(vocab_size: int, divisible_by: int) -> dict:
    from ...data.datasets import padded_vocab_size

    # Padded by the divisor alone, as training/loop.py does: the same vocabulary at every TP.
    padded = padded_vocab_size(vocab_size, divisible_by, 1)
    return {"vocab_size": vocab_size, "padded_vocab_size": padded, "make_vocab_size_divisible_by": divisible_by}


def _common_args(cfg, layers: int, hidden: int, heads: int, groups: int, max_positions: int) -> dict:
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "max_position_embeddings": max_positions,
        "seq_length": max_positions,
        "init_method_std": cfg.initializer_range,
        "layernorm_zero_centered_gamma": False,
        "apply_residual_connection_post_layernorm": False,
        "qk_layernorm": False,
        "squared_relu": False,
        "add_qkv_bias": False,  # the QKV bias follows add_bias_linear in both architectures
    }


def _llama_args(cfg, divisible_by: int) -> dict:
    if cfg.hidden_act != "silu":
        _refuse("hidden_act", cfg.hidden_act, "megatron's --swiglu gates with SiLU")
    if bool(cfg.attention_bias) != bool(getattr(cfg, "mlp_bias", False)):
        _refuse("attention_bias", cfg.attention_bias, "megatron's --disable-bias-linear sets mlp_bias with it")
    heads = cfg.num_attention_heads
    groups = cfg.num_key_value_heads or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    args = _common_args(cfg, cfg.num_hidden_layers, cfg.hidden_size, heads, groups, cfg.max_position_embeddings)
    args.update(**_rope_settings(cfg), **_vocab_args(cfg.vocab_size, divisible_by))
    args.update(
        ffn_hidden_size=cfg.intermediate_size,
        kv_channels=head_dim,
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        swiglu=True,
        openai_gelu=False,
        add_bias_linear=bool(cfg.attention_bias),
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.attention_dropout),
    )
    return args


def _gpt2_args(cfg, divisible_by: int) -> dict:
    act = cfg.activation_function
    if act not in GELU_TANH + ("gelu",):
        _refuse("activation_function", act, f"only {GELU_TANH} (megatron's --openai-gelu) and gelu map")
    if not cfg.tie_word_embeddings:
        _refuse("tie_word_embeddings", False, "GPT-2 is converted only with lm_head tied to wte")
    if not cfg.scale_attn_weights:
        _refuse("scale_attn_weights", False, "megatron scales scores by 1/sqrt(head_dim)")
    if cfg.scale_attn_by_inverse_layer_idx:
        _refuse("scale_attn_by_inverse_layer_idx", True, "megatron scales scores by 1/sqrt(head_dim) only")
    if getattr(cfg, "add_cross_attention", False):
        _refuse("add_cross_attention", True, "GPTModel is decoder only")
    # reorder_and_upcast_attn only moves the fp32 upcast: accepted, not carried.
    hidden, heads = cfg.n_embd, cfg.n_head
    args = _common_args(cfg, cfg.n_layer, hidden, heads, heads, cfg.n_positions)
    args.update(_vocab_args(cfg.vocab_size, divisible_by))
    args.update(
        ffn_hidden_size=cfg.n_inner or 4 * hidden,
        kv_channels=hidden // heads,
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        layernorm_epsilon=float(cfg.layer_norm_epsilon),
        swiglu=False,
        openai_gelu=act in GELU_TANH,
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        hidden_dropout=float(cfg.resid_pdrop),
        attention_dropout=float(cfg.attn_pdrop),
    )
    return args


def moe_layer_pattern(model_args: dict) -> list[bool]:
    """Which layers are MoE layers (config.py reads --moe-layer-freq); a pattern of another length is
    refused naming the setting."""
    from .config import moe_layer_pattern as pattern

    try:
        return pattern(model_args)
    except ValueError:
        _refuse(
            "moe_layer_freq",
            model_args["moe_layer_freq"],
            f"one entry per layer is needed (num_layers={model_args['num_layers']})",
        )


def _qwen3_moe_pattern(cfg) -> list[bool]:
    """Qwen3MoeDecoderLayer's choice (transformers/models/qwen3_moe/modeling_qwen3_moe.py): a sparse
    block unless the layer is in mlp_only_layers, and only every decoder_sparse_step-th layer
    counting from 1 (layers step-1, 2*step-1, ...; megatron's integer frequency counts from 0)."""
    dense = set(cfg.mlp_only_layers or [])
    step = cfg.decoder_sparse_step
    return [i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]


def _qwen3_moe_sparsity(pattern: list[bool]) -> dict:
    """decoder_sparse_step and mlp_only_layers of a layer pattern: a step alone where one gives it
    exactly, else step 1 and the dense layers listed."""
    for step in range(1, len(pattern) + 1):
        if pattern == [(i + 1) % step == 0 for i in range(len(pattern))]:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, sparse in enumerate(pattern) if not sparse]}


def _qwen3_moe_args(cfg, divisible_by: int) -> dict:
    """Qwen3MoeConfig (transformers/models/qwen3_moe/configuration_qwen3_moe.py) as Megatron-LM dests:
    a Llama-style decoder with q_norm/k_norm (--qk-layernorm) whose MLPs are megatron-core MoE layers
    (--num-experts, --moe-*), dense ones where --moe-layer-freq says 0."""
    if cfg.hidden_act != "silu":
        _refuse("hidden_act", cfg.hidden_act, "megatron's --swiglu gates with SiLU")
    if cfg.attention_bias:
        _refuse("attention_bias", True, "megatron's QKV and output biases come with MLP and expert biases")
    if getattr(cfg, "use_sliding_window", False):
        _refuse("use_sliding_window", True, "megatron-core's GPTModel attends over the whole causal window")
    if not cfg.num_experts:
        _refuse("num_experts", cfg.num_experts, "a Qwen3MoeForCausalLM without experts is not converted")
    if cfg.num_experts_per_tok == 1 and cfg.norm_topk_prob:
        _refuse(
            "norm_topk_prob",
            True,
            "at num_experts_per_tok=1 it weights every token's expert by 1, and megatron-core's top-1 softmax "
            "router needs --moe-router-pre-softmax (weights the softmax probability)",
        )
    pattern = _qwen3_moe_pattern(cfg)
    if not any(pattern):
        _refuse("mlp_only_layers", cfg.mlp_only_layers, "no layer is an MoE layer")
    heads = cfg.num_attention_heads
    groups = cfg.num_key_value_heads or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    args = _common_args(cfg, cfg.num_hidden_layers, cfg.hidden_size, heads, groups, cfg.max_position_embeddings)
    args.update(**_rope_settings(cfg), **_vocab_args(cfg.vocab_size, divisible_by))
    args.update(
        ffn_hidden_size=cfg.intermediate_size,  # the dense (mlp_only) layers' Qwen3MoeMLP
        kv_channels=head_dim,
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),  # q_norm/k_norm use it too, as megatron's qk layernorm
        qk_layernorm=True,
        swiglu=True,
        openai_gelu=False,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.attention_dropout),
        num_experts=cfg.num_experts,
        moe_layer_freq=1 if all(pattern) else [int(p) for p in pattern],
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_topk=cfg.num_experts_per_tok,
        # Qwen3MoeTopKRouter: softmax over all experts, top-k, then (norm_topk_prob) divided by the
        # top-k sum, i.e. a softmax over the top-k logits: megatron-core's default top-k then softmax
        # (moe/moe_utils.py topk_routing_with_score_function at core_v0.16.1). Without the division it
        # is --moe-router-pre-softmax: softmax over all experts, then top-k.
        moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        # The coefficient only: transformers' load_balancing_loss_func (modeling_qwen3_moe.py) pools the
        # expert counts and probabilities over all layers, and is added only with output_router_logits;
        # megatron-core's switch_load_balancing_loss_func (moe/moe_utils.py) is per layer, divided by the
        # top-k, and summed. Training only: the logits do not depend on it.
        moe_aux_loss_coeff=float(cfg.router_aux_loss_coef),
    )
    return args


# transformers' YaRN settings (DeepseekV3Config rope_parameters) -> our --yarn-* dests (models/gpt/config.py
# MLA_YARN_FIELDS maps them onto MLATransformerConfig), with MLATransformerConfig's defaults (transformer_config.py
# at core_v0.16.1), written on export when a run left them unset.
MLA_YARN_DESTS = {
    "original_max_position_embeddings": ("yarn_original_max_position_embeddings", 4096),
    "beta_fast": ("yarn_beta_fast", 32.0),
    "beta_slow": ("yarn_beta_slow", 1.0),
}
# DeepseekV3Attention's q_a_layernorm and kv_a_layernorm are DeepseekV3RMSNorm(rank) at its default eps;
# megatron-core's q_layernorm/kv_layernorm use --norm-epsilon like every other norm.
DEEPSEEK_V3_LATENT_NORM_EPS = 1e-6


def _deepseek_v3_rope(cfg) -> dict:
    """MLA's rotary dests of a DeepseekV3Config's rope_parameters (transformers/modeling_rope_utils.py
    _compute_yarn_parameters, yarn_apply_mscale) against megatron-core's MLASelfAttention (rope_type rope:
    RotaryEmbedding; yarn: YarnRotaryEmbedding, models/common/embeddings/yarn_rotary_pos_embedding.py, and the
    softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q/k head dim), transformer/multi_latent_attention.py)."""
    params = dict(getattr(cfg, "rope_scaling", None) or {})
    params.update(getattr(cfg, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        _refuse("rope_theta", theta, "the rotary base is not set")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", params["partial_rotary_factor"], "MLA rotates all qk_rope_head_dim dims")
    settings = {"rotary_base": int(theta) if float(theta).is_integer() else float(theta), "rotary_percent": 1.0}
    if rope_type == "default":
        # rope_type rope: no YaRN; factor 1 keeps MLA's softmax scale at 1 / sqrt(q/k head dim)
        return dict(settings, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope_type != "yarn":
        _refuse("rope_parameters.rope_type", rope_type, "megatron-core's MLA has default (rope) and yarn RoPE only")
    if params.get("truncate", True) is not True:  # transformers' default: True, as megatron-core's MLA always
        _refuse("rope_parameters.truncate", params["truncate"], "megatron-core's MLA YaRN always rounds the range")
    if params.get("original_max_position_embeddings") is None:
        _refuse("rope_parameters.original_max_position_embeddings", None, "YaRN's original context length is unset")
    # transformers' defaults where unset: beta_fast 32, beta_slow 1 (modeling_rope_utils.py)
    yarn = {dest: float(params.get(key) or default) for key, (dest, default) in MLA_YARN_DESTS.items()}
    yarn["yarn_original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if params.get("attention_factor") is not None:
        _refuse("rope_parameters.attention_factor", params["attention_factor"], "megatron derives it from mscale")
    factor = params.get("factor")
    if factor is None:
        _refuse("rope_parameters.factor", None, "megatron's --rotary-scaling-factor must be given")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers: attention factor mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set (truthy),
    # else mscale(f, 1); softmax scale x mscale(f, mscale_all_dim)^2 when mscale_all_dim is set. megatron-core:
    # always mscale(f, --mscale) / mscale(f, --mscale-all-dim), and mscale(f, 0) = 1.
    if all_dim and not mscale:
        _refuse(
            "rope_parameters.mscale",
            mscale,
            "with mscale_all_dim set, transformers then ignores mscale_all_dim in the rotary scale; megatron does not",
        )
    if not all_dim:
        mscale, all_dim = 1.0, 0.0  # transformers' mscale(f, 1); megatron's mscale(f, 1) / mscale(f, 0)
    return dict(
        settings,
        rope_type="yarn",
        rotary_scaling_factor=float(factor),
        mscale=float(mscale),
        mscale_all_dim=float(all_dim),
        **yarn,
    )


def _deepseek_v3_checked(cfg) -> tuple[int, int, int, bool, int]:
    """The DeepseekV3Config settings megatron-core cannot express, refused by name; then (top-k, router
    groups, group top-k, whether groups are limited, dense first layers)."""
    if cfg.hidden_act != "silu":
        _refuse("hidden_act", cfg.hidden_act, "megatron's --swiglu gates with SiLU")
    if cfg.attention_bias:
        _refuse("attention_bias", True, "megatron-core's MLA projections have no bias")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        _refuse("num_key_value_heads", cfg.num_key_value_heads, "MLA gives every head its own key and value")
    if float(cfg.rms_norm_eps) != DEEPSEEK_V3_LATENT_NORM_EPS:
        _refuse(
            "rms_norm_eps",
            cfg.rms_norm_eps,
            f"q_a_layernorm/kv_a_layernorm use {DEEPSEEK_V3_LATENT_NORM_EPS}; megatron's use --norm-epsilon",
        )
    if not cfg.rope_interleave:
        _refuse("rope_interleave", False, "megatron-core's MLA de-interleaves the rotary dims (rope_utils.py)")
    if not cfg.n_shared_experts:
        _refuse("n_shared_experts", cfg.n_shared_experts, "a DeepSeek-V3 MoE layer is converted with its shared expert")
    topk, groups, group_topk = cfg.num_experts_per_tok, cfg.n_group or 1, cfg.topk_group or 1
    if cfg.n_routed_experts % groups:
        _refuse("n_group", groups, f"does not divide n_routed_experts={cfg.n_routed_experts}")
    limited = group_topk < groups  # all groups kept: no group limit (Moonlight's and Kimi K2's n_group=1)
    if limited and topk != 2 * group_topk:
        # DeepseekV3TopkRouter ranks groups by their top-2 scores; megatron-core's group_limited_topk
        # (moe/moe_utils.py) by their top-(topk // group_topk)
        _refuse("topk_group", group_topk, f"megatron ranks groups by top-(topk/topk_group), {topk}/{group_topk} != 2")
    if cfg.norm_topk_prob != (topk > 1):
        # megatron-core's sigmoid routing divides the top-k scores by their sum exactly when topk > 1
        _refuse("norm_topk_prob", cfg.norm_topk_prob, f"megatron's sigmoid router normalizes iff topk > 1 ({topk})")
    dense = min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers)
    if dense == cfg.num_hidden_layers:
        _refuse("first_k_dense_replace", cfg.first_k_dense_replace, "no layer is an MoE layer")
    return topk, groups, group_topk, limited, dense


def _deepseek_v3_args(cfg, divisible_by: int) -> dict:
    """DeepseekV3Config (transformers/models/deepseek_v3/configuration_deepseek_v3.py) as Megatron-LM dests:
    multi-latent attention (--multi-latent-attention, --q-lora-rank, ..., --qk-layernorm for q_a_layernorm and
    kv_a_layernorm), first_k_dense_replace dense layers (--moe-layer-freq as a 0/1 list, --ffn-hidden-size),
    then MoE layers with one shared expert MLP and a sigmoid router with group-limited top-k and the
    aux-loss-free expert bias (e_score_correction_bias)."""
    topk, groups, group_topk, limited, dense = _deepseek_v3_checked(cfg)
    heads = cfg.num_attention_heads
    args = _common_args(cfg, cfg.num_hidden_layers, cfg.hidden_size, heads, heads, cfg.max_position_embeddings)
    args.update(**_deepseek_v3_rope(cfg), **_vocab_args(cfg.vocab_size, divisible_by))
    args.update(
        # what a pretrain_gpt.py run with --multi-latent-attention stores (MLA has no query groups, and
        # Megatron-LM's validate_args sets kv_channels to hidden / heads; MLA reads its own head dims)
        num_query_groups=1,
        kv_channels=cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size,  # the first_k_dense_replace layers' DeepseekV3MLP
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        qk_layernorm=True,  # q_a_layernorm, kv_a_layernorm
        swiglu=True,
        openai_gelu=False,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
        hidden_dropout=0.0,
        attention_dropout=float(cfg.attention_dropout),
        multi_latent_attention=True,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        num_experts=cfg.n_routed_experts,
        moe_layer_freq=[int(i >= dense) for i in range(cfg.num_hidden_layers)],
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,  # e_score_correction_bias <-> the router's expert_bias buffer
        moe_router_num_groups=groups if limited else None,
        moe_router_group_topk=group_topk if limited else None,
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
        moe_router_pre_softmax=False,
        # DeepSeek-V3 balances with the expert bias; transformers computes no auxiliary loss for it
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )
    return args


# ----------------------------------------------------------------------------------------
# Settings: model_args -> HF config, TransformerConfig
# ----------------------------------------------------------------------------------------


def _resolved(model_args: dict) -> dict:
    """model_args with Megatron-LM's defaults filled in and derived values resolved."""
    args = {**MEGATRON_DEFAULTS, **model_args}
    missing = [k for k in REQUIRED_ARGS if args.get(k) is None]
    if missing:
        raise ConversionError(f"model_args lacks {missing}")
    if not args["group_query_attention"]:
        args["num_query_groups"] = args["num_attention_heads"]
    args["kv_channels"] = args["kv_channels"] or args["hidden_size"] // args["num_attention_heads"]
    if args["padded_vocab_size"] is None and args["vocab_size"] is not None:
        args.update(_vocab_args(args["vocab_size"], args["make_vocab_size_divisible_by"]))
    if args["num_experts"] and args["moe_ffn_hidden_size"] is None:
        args["moe_ffn_hidden_size"] = args["ffn_hidden_size"]
    return args


def transformer_args(model_args: dict) -> dict:
    """``model_args`` (or a whole stored ``vars(args)``) with Megatron-LM's defaults filled in and
    the derived settings resolved (num_query_groups without GQA, kv_channels, padded_vocab_size)."""
    return _resolved(model_args)


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def architecture(model_args: dict) -> str:
    """The Hugging Face model_type a model_args dict converts to: deepseek_v3 with experts and
    --multi-latent-attention, qwen3_moe with experts (--num-experts), else llama with --swiglu, else gpt2
    (``ARCHITECTURES`` names their classes)."""
    args = _resolved(model_args)
    if args["num_experts"]:
        return "deepseek_v3" if args["multi_latent_attention"] else "qwen3_moe"
    return "llama" if args["swiglu"] else "gpt2"


def _refuse_unsupported(model_args: dict) -> None:
    """Megatron settings with no counterpart in the Hugging Face architecture chosen."""
    moe = bool(model_args["num_experts"])
    mla = moe and bool(model_args["multi_latent_attention"])
    if model_args["mtp_num_layers"]:
        _refuse("mtp_num_layers", model_args["mtp_num_layers"], "multi-token prediction modules are not converted")
    for dest in (
        "qk_layernorm",
        "rotary_interleaved",
        "layernorm_zero_centered_gamma",
        "apply_residual_connection_post_layernorm",
        "squared_relu",
        "quick_geglu",
        "multi_latent_attention",
        "num_experts",
        "rotary_seq_len_interpolation_factor",
    ):
        if moe and dest in ("qk_layernorm", "num_experts") or mla and dest == "multi_latent_attention":
            continue
        if model_args[dest]:
            _refuse(dest, model_args[dest], "neither LlamaForCausalLM nor GPT2LMHeadModel has it")
    if model_args["rotary_percent"] != 1.0:
        _refuse("rotary_percent", model_args["rotary_percent"], "LlamaForCausalLM rotates the whole head")
    if mla:
        _refuse_unsupported_deepseek_v3(model_args)
    elif moe:
        _refuse_unsupported_moe(model_args)


def _refuse_unsupported_deepseek_v3(args: dict) -> None:
    """megatron-core MoE and MLA settings that DeepseekV3ForCausalLM cannot express (its router: sigmoid,
    e_score_correction_bias for the choice only, groups ranked by their top-2 scores, top-k renormalized,
    times routed_scaling_factor; one ungated shared expert MLP of n_shared_experts x moe_intermediate_size)."""
    arch = "DeepseekV3ForCausalLM"
    shared, size = args["moe_shared_expert_intermediate_size"], args["moe_ffn_hidden_size"]
    if not shared or shared % size:
        _refuse("moe_shared_expert_intermediate_size", shared, f"{arch}'s shared expert is n x {size} wide")
    if args.get("moe_shared_expert_gate"):
        _refuse("moe_shared_expert_gate", True, f"{arch}'s shared expert has no gate")
    if args["moe_router_score_function"] != "sigmoid":
        _refuse("moe_router_score_function", args["moe_router_score_function"], f"{arch}'s router scores by sigmoid")
    groups, group_topk, topk = args["moe_router_num_groups"], args["moe_router_group_topk"], args["moe_router_topk"]
    if bool(groups) != bool(group_topk):
        _refuse("moe_router_group_topk", group_topk, f"needs moe_router_num_groups (={groups}) with it")
    if group_topk and group_topk < groups and topk != 2 * group_topk:
        _refuse("moe_router_group_topk", group_topk, f"{arch} ranks groups by top-2 scores; topk/group_topk != 2")
    if args["moe_expert_capacity_factor"] is not None:
        _refuse("moe_expert_capacity_factor", args["moe_expert_capacity_factor"], f"{arch} drops no tokens")
    if args["moe_apply_probs_on_input"]:
        _refuse("moe_apply_probs_on_input", True, f"{arch} scales each expert's output by its weight")
    balancing = args["moe_router_load_balancing_type"]
    if "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]):
        _refuse("moe_router_load_balancing_type", balancing, f"{arch} routes by sigmoid top-k, not Sinkhorn")
    if args["rotary_percent"] != 1.0:
        _refuse("rotary_percent", args["rotary_percent"], f"{arch} rotates all qk_rope_head_dim dims")
    factor = float(args["rotary_scaling_factor"])
    mscale, all_dim = float(args["mscale"]), float(args["mscale_all_dim"])
    if (args["rope_type"] or "yarn") == "rope":
        if factor > 1 and all_dim:
            _refuse("mscale_all_dim", all_dim, f"with rope_type rope megatron still scales the softmax; {arch} not")
    elif factor > 1 and (mscale != 1 if not all_dim else not mscale):
        # transformers' YaRN (modeling_rope_utils.py): mscale(f, mscale) / mscale(f, mscale_all_dim) only when
        # both are set, else mscale(f, 1)
        _refuse("mscale", mscale, f"{arch}'s YaRN reads mscale only with mscale_all_dim set (={all_dim})")


def _refuse_unsupported_moe(args: dict) -> None:
    """megatron-core MoE settings that change the forward and that Qwen3MoeForCausalLM cannot express
    (its router: softmax, top-k, optional renormalization; its experts: SwiGLU without bias)."""
    arch = "Qwen3MoeForCausalLM"
    if args["moe_shared_expert_intermediate_size"]:
        _refuse(
            "moe_shared_expert_intermediate_size",
            args["moe_shared_expert_intermediate_size"],
            f"{arch} has no shared expert",
        )
    if args["moe_router_score_function"] != "softmax":
        _refuse(
            "moe_router_score_function", args["moe_router_score_function"], f"{arch}'s router scores with a softmax"
        )
    if args["moe_router_topk_scaling_factor"] not in (None, 1.0):
        _refuse(
            "moe_router_topk_scaling_factor",
            args["moe_router_topk_scaling_factor"],
            f"{arch} does not scale its routing weights",
        )
    for dest in ("moe_router_num_groups", "moe_router_group_topk"):
        if args[dest]:
            _refuse(dest, args[dest], f"{arch} has no group-limited routing")
    if args["moe_router_enable_expert_bias"]:
        _refuse("moe_router_enable_expert_bias", True, f"{arch}'s router has no expert bias")
    if args["moe_expert_capacity_factor"] is not None:
        _refuse("moe_expert_capacity_factor", args["moe_expert_capacity_factor"], f"{arch} drops no tokens")
    if args["moe_apply_probs_on_input"]:
        _refuse("moe_apply_probs_on_input", True, f"{arch} scales each expert's output by its weight")
    balancing = args["moe_router_load_balancing_type"]
    if "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]):
        _refuse("moe_router_load_balancing_type", balancing, f"{arch} routes by softmax top-k, not Sinkhorn")
    coeff = args["moe_aux_loss_coeff"]
    if isinstance(coeff, list) and len(coeff) != 1:
        _refuse("moe_aux_loss_coeff", coeff, f"{arch} has one router_aux_loss_coef")


def _expect(model_args: dict, arch: str, **wanted) -> None:
    for dest, value in wanted.items():
        if model_args[dest] != value:
            _refuse(dest, model_args[dest], f"{arch} needs {dest}={value!r}")


def _llama_style_fields(model_args: dict) -> dict:
    """The config fields LlamaConfig and Qwen3MoeConfig share, from the same Megatron-LM dests."""
    return dict(
        vocab_size=model_args["vocab_size"],
        hidden_size=model_args["hidden_size"],
        intermediate_size=model_args["ffn_hidden_size"],
        num_hidden_layers=model_args["num_layers"],
        num_attention_heads=model_args["num_attention_heads"],
        num_key_value_heads=model_args["num_query_groups"],
        head_dim=model_args["kv_channels"],
        hidden_act="silu",
        max_position_embeddings=model_args["max_position_embeddings"],
        initializer_range=model_args["init_method_std"],
        rms_norm_eps=model_args["layernorm_epsilon"],
        tie_word_embeddings=not model_args["untie_embeddings_and_output_weights"],
    )


def _llama_config(model_args: dict):
    from transformers import LlamaConfig

    _expect(
        model_args, "LlamaForCausalLM (chosen by swiglu=True)", normalization="RMSNorm", position_embedding_type="rope"
    )
    if model_args["add_qkv_bias"] and not model_args["add_bias_linear"]:
        _refuse("add_qkv_bias", True, "LlamaForCausalLM's attention_bias also adds an o_proj bias")
    scaling = None
    if model_args["use_rope_scaling"]:
        scaling = {"rope_type": "llama3", "factor": float(model_args["rope_scaling_factor"]), **LLAMA3_ROPE}
    bias = bool(model_args["add_bias_linear"])
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        **_llama_style_fields(model_args),
        rope_theta=float(model_args["rotary_base"]),
        rope_scaling=scaling,
        attention_bias=bias,
        mlp_bias=bias,
        attention_dropout=model_args["attention_dropout"],
    )


def _gpt2_config(model_args: dict):
    from transformers import GPT2Config

    heads, hidden = model_args["num_attention_heads"], model_args["hidden_size"]
    _expect(
        model_args,
        "GPT2LMHeadModel (chosen by swiglu=False)",
        normalization="LayerNorm",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        num_query_groups=heads,
        kv_channels=hidden // heads,
    )
    return GPT2Config(
        architectures=["GPT2LMHeadModel"],
        vocab_size=model_args["vocab_size"],
        n_positions=model_args["max_position_embeddings"],
        n_embd=hidden,
        n_layer=model_args["num_layers"],
        n_head=heads,
        n_inner=None if model_args["ffn_hidden_size"] == 4 * hidden else model_args["ffn_hidden_size"],
        activation_function="gelu_new" if model_args["openai_gelu"] else "gelu",
        resid_pdrop=model_args["hidden_dropout"],
        embd_pdrop=model_args["hidden_dropout"],
        attn_pdrop=model_args["attention_dropout"],
        layer_norm_epsilon=model_args["layernorm_epsilon"],
        initializer_range=model_args["init_method_std"],
        tie_word_embeddings=True,
    )


def _qwen3_moe_config(model_args: dict):
    from transformers import Qwen3MoeConfig

    _expect(
        model_args,
        "Qwen3MoeForCausalLM (chosen by num_experts)",
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
    )
    topk, coeff = model_args["moe_router_topk"], model_args["moe_aux_loss_coeff"]
    rope = {"rope_type": "default", "rope_theta": float(model_args["rotary_base"])}
    if model_args["use_rope_scaling"]:
        rope.update(rope_type="llama3", factor=float(model_args["rope_scaling_factor"]), **LLAMA3_ROPE)
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"],
        **_llama_style_fields(model_args),
        rope_parameters=rope,
        attention_bias=False,
        attention_dropout=model_args["attention_dropout"],
        num_experts=model_args["num_experts"],
        num_experts_per_tok=topk,
        moe_intermediate_size=model_args["moe_ffn_hidden_size"],
        # megatron-core's top-k then softmax is Qwen3's renormalized top-k (see _qwen3_moe_args)
        norm_topk_prob=not model_args["moe_router_pre_softmax"],
        router_aux_loss_coef=float(coeff[0] if isinstance(coeff, list) else coeff),
        **_qwen3_moe_sparsity(moe_layer_pattern(model_args)),
    )


def _deepseek_v3_config(model_args: dict):
    from transformers import DeepseekV3Config

    _expect(
        model_args,
        "DeepseekV3ForCausalLM (chosen by num_experts with multi_latent_attention)",
        swiglu=True,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        layernorm_epsilon=DEEPSEEK_V3_LATENT_NORM_EPS,
    )
    pattern = moe_layer_pattern(model_args)
    dense = pattern.index(True) if any(pattern) else len(pattern)
    if pattern != [i >= dense for i in range(len(pattern))]:
        _refuse("moe_layer_freq", model_args["moe_layer_freq"], "DeepSeek-V3 has dense layers first, then MoE only")
    rope = {"rope_type": "default", "rope_theta": float(model_args["rotary_base"])}
    if (model_args["rope_type"] or "yarn") == "yarn":
        yarn = {key: model_args.get(dest) or default for key, (dest, default) in MLA_YARN_DESTS.items()}
        rope.update(rope_type="yarn", factor=float(model_args["rotary_scaling_factor"]), **yarn)
        rope.update(mscale=float(model_args["mscale"]), mscale_all_dim=float(model_args["mscale_all_dim"]))
    groups, group_topk = model_args["moe_router_num_groups"], model_args["moe_router_group_topk"]
    scaling = model_args["moe_router_topk_scaling_factor"]
    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=model_args["vocab_size"],
        hidden_size=model_args["hidden_size"],
        intermediate_size=model_args["ffn_hidden_size"],
        moe_intermediate_size=model_args["moe_ffn_hidden_size"],
        num_hidden_layers=model_args["num_layers"],
        num_attention_heads=model_args["num_attention_heads"],
        num_key_value_heads=model_args["num_attention_heads"],
        n_shared_experts=model_args["moe_shared_expert_intermediate_size"] // model_args["moe_ffn_hidden_size"],
        n_routed_experts=model_args["num_experts"],
        routed_scaling_factor=1.0 if scaling is None else float(scaling),
        kv_lora_rank=model_args["kv_lora_rank"],
        q_lora_rank=model_args["q_lora_rank"],
        qk_rope_head_dim=model_args["qk_pos_emb_head_dim"],
        v_head_dim=model_args["v_head_dim"],
        qk_nope_head_dim=model_args["qk_head_dim"],
        n_group=groups or 1,
        topk_group=group_topk or 1,
        num_experts_per_tok=model_args["moe_router_topk"],
        first_k_dense_replace=dense,
        norm_topk_prob=model_args["moe_router_topk"] > 1,  # megatron's sigmoid router (see _deepseek_v3_args)
        hidden_act="silu",
        max_position_embeddings=model_args["max_position_embeddings"],
        initializer_range=model_args["init_method_std"],
        rms_norm_eps=model_args["layernorm_epsilon"],
        tie_word_embeddings=not model_args["untie_embeddings_and_output_weights"],
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=False,
        attention_dropout=model_args["attention_dropout"],
        num_nextn_predict_layers=0,
    )


# megatron-core TransformerConfig fields of an MoE model that are also Megatron-LM dests of the same name
MOE_CONFIG_FIELDS = (
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_shared_expert_intermediate_size",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
)
# MLATransformerConfig fields (transformer_config.py at core_v0.16.1) that are Megatron-LM dests of the same name
MLA_CONFIG_FIELDS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_base",
    "rotary_percent",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
)


def transformer_config_kwargs(model_args: dict) -> tuple[dict, dict]:
    """(megatron-core TransformerConfig kwargs, MLATransformerConfig's with multi_latent_attention,
    build_gpt_model kwargs) of a model_args dict:
    the model's own settings only; add the run's (use_cpu_initialization, dtypes, parallel
    sizes, fusions) before building. Settings the converter refuses are refused here too."""
    import torch.nn.functional as F
    from megatron.core.transformer.utils import openai_gelu

    args = _resolved(model_args)
    _refuse_unsupported(args)
    if args["padded_vocab_size"] is None:
        raise ConversionError("model_args needs vocab_size or padded_vocab_size")
    activation = F.silu if args["swiglu"] else openai_gelu if args["openai_gelu"] else F.gelu
    config = {k: args[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")}
    config.update({k: args[k] for k in ("num_query_groups", "kv_channels", "normalization", "layernorm_epsilon")})
    config.update({k: args[k] for k in ("add_bias_linear", "add_qkv_bias", "hidden_dropout", "attention_dropout")})
    config.update(gated_linear_unit=args["swiglu"], activation_func=activation, init_method_std=args["init_method_std"])
    config.update(qk_layernorm=args["qk_layernorm"])
    if args["num_experts"]:
        config.update({k: args[k] for k in MOE_CONFIG_FIELDS}, num_moe_experts=args["num_experts"])
    if args["multi_latent_attention"]:  # build with MLATransformerConfig (config.py transformer_config does)
        config.update({k: args[k] for k in MLA_CONFIG_FIELDS}, num_query_groups=None)
        from .config import mla_yarn_fields

        config.update({"rope_type": args["rope_type"]} if args["rope_type"] else {}, **mla_yarn_fields(args))
    model = {
        "vocab_size": args["padded_vocab_size"],
        "max_sequence_length": args["max_position_embeddings"],
        "position_embedding_type": args["position_embedding_type"],
        "share_embeddings_and_output_weights": not args["untie_embeddings_and_output_weights"],
        "rotary_base": args["rotary_base"],
        "rotary_percent": args["rotary_percent"],
        "rope_scaling": args["use_rope_scaling"],
        "rope_scaling_factor": args["rope_scaling_factor"],
    }
    return config, model


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------


def _llama_table(model_args: dict, i: int):
    ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
    table = [
        (ours + "input_layernorm.weight", theirs + "input_layernorm.weight", False),
        (ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight", False),
    ]
    for leaf in ("weight", "bias") if model_args["add_bias_linear"] else ("weight",):
        table.append((f"{ours}self_attention.linear_proj.{leaf}", f"{theirs}self_attn.o_proj.{leaf}", False))
        table.append((f"{ours}mlp.linear_fc2.{leaf}", f"{theirs}mlp.down_proj.{leaf}", False))
    return table


_GPT2_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
_GPT2_LINEARS = (
    ("self_attention.linear_proj", "attn.c_proj"),
    ("mlp.linear_fc1", "mlp.c_fc"),
    ("mlp.linear_fc2", "mlp.c_proj"),
)


def _gpt2_table(i: int):
    ours, theirs = f"decoder.layers.{i}.", f"transformer.h.{i}."
    table = [(f"{ours}{o}.{leaf}", f"{theirs}{t}.{leaf}", False) for o, t in _GPT2_NORMS for leaf in ("weight", "bias")]
    for o, t in _GPT2_LINEARS:
        table += [(f"{ours}{o}.weight", f"{theirs}{t}.weight", True), (f"{ours}{o}.bias", f"{theirs}{t}.bias", False)]
    return table


_GPT2_GLOBAL = [
    ("embedding.position_embeddings.weight", "transformer.wpe.weight", False),
    ("decoder.final_layernorm.weight", "transformer.ln_f.weight", False),
    ("decoder.final_layernorm.bias", "transformer.ln_f.bias", False),
]


def _llama_layers(src: _Tensors, dst: dict, model_args: dict, to_megatron: bool) -> None:
    """Per layer: Q, K, V <-> grouped linear_qkv, gate, up <-> linear_fc1, the rest renamed."""
    heads, groups = model_args["num_attention_heads"], model_args["num_query_groups"]
    head_dim = model_args["kv_channels"]
    for i in range(model_args["num_layers"]):
        _copy(src, dst, _llama_table(model_args, i), to_megatron)
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        for leaf in ("weight", "bias") if model_args["add_bias_linear"] else ("weight",):
            qkv, fc1 = f"{ours}self_attention.linear_qkv.{leaf}", f"{ours}mlp.linear_fc1.{leaf}"
            names = [f"{theirs}self_attn.{p}_proj.{leaf}" for p in "qkv"]
            gate_up = [f"{theirs}mlp.{p}_proj.{leaf}" for p in ("gate", "up")]
            if to_megatron:
                dst[qkv] = fuse_qkv(*(src.pop(n) for n in names), groups)
                dst[fc1] = fuse_gate_up(*(src.pop(n) for n in gate_up))
            else:
                dst.update(zip(names, split_qkv(src.pop(qkv), heads, groups, head_dim)))
                dst.update(zip(gate_up, split_gate_up(src.pop(fc1))))


def _gpt2_layers(src: _Tensors, dst: dict, model_args: dict, to_megatron: bool) -> None:
    """Per layer: c_attn ([in, out], columns Q | K | V) <-> linear_qkv grouped per head, the
    rest renamed, the Conv1D weights transposed."""
    heads, head_dim = model_args["num_attention_heads"], model_args["kv_channels"]
    for i in range(model_args["num_layers"]):
        _copy(src, dst, _gpt2_table(i), to_megatron)
        ours, theirs = f"decoder.layers.{i}.self_attention.linear_qkv.", f"transformer.h.{i}.attn.c_attn."
        for leaf in ("weight", "bias"):
            if to_megatron:
                rows = src.pop(theirs + leaf).t()
                dst[ours + leaf] = fuse_qkv(*rows.chunk(3), heads)
            else:
                joined = torch.cat(split_qkv(src.pop(ours + leaf), heads, heads, head_dim))
                dst[theirs + leaf] = joined.t().contiguous()


def _swiglu_mlp(src: _Tensors, dst: dict, ours: str, theirs: str, to_megatron: bool) -> None:
    """One bias-free SwiGLU MLP: HF's gate_proj, up_proj, down_proj (under ``theirs``) <-> megatron's
    linear_fc1 (gate | up) and linear_fc2 (under ``ours``)."""
    fc1, fc2 = ours + "linear_fc1.weight", ours + "linear_fc2.weight"
    gate, up, down = (f"{theirs}{p}_proj.weight" for p in ("gate", "up", "down"))
    if to_megatron:
        dst[fc1] = fuse_gate_up(src.pop(gate), src.pop(up))
    else:
        dst[gate], dst[up] = split_gate_up(src.pop(fc1))
    _copy(src, dst, [(fc2, down, False)], to_megatron)


def _expert_prefixes(model_args: dict, i: int) -> list[tuple[str, str]]:
    """(ours, theirs) name prefixes of layer ``i``'s experts: megatron-core SequentialMLP's
    ``mlp.experts.local_experts.{e}`` (global expert e in a 1 x 1 x 1 model) and HF's
    ``mlp.experts.{e}`` (one Linear per expert, as Qwen3-MoE checkpoints store them)."""
    ours, theirs = f"decoder.layers.{i}.mlp.experts.local_experts.", f"model.layers.{i}.mlp.experts."
    return [(f"{ours}{e}.", f"{theirs}{e}.") for e in range(model_args["num_experts"])]


def _qwen3_moe_layers(src: _Tensors, dst: dict, model_args: dict, to_megatron: bool) -> None:
    """Per layer (transformers/models/qwen3_moe/modeling_qwen3_moe.py: Qwen3MoeDecoderLayer): Q, K, V
    <-> grouped linear_qkv, q_norm/k_norm <-> q_layernorm/k_layernorm (megatron-core's SelfAttention
    normalizes each head before RoPE, as Qwen3MoeAttention), and the MLP: a Qwen3MoeMLP <-> megatron's
    dense MLP; a Qwen3MoeSparseMoeBlock <-> megatron-core's MoELayer (moe/moe_layer.py), its gate <->
    the router's weight (moe/router.py TopKRouter) and each expert <-> one SequentialMLP local expert
    (moe/experts.py)."""
    heads, groups = model_args["num_attention_heads"], model_args["num_query_groups"]
    head_dim = model_args["kv_channels"]
    for i, sparse in enumerate(moe_layer_pattern(model_args)):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        table = [
            (ours + "input_layernorm.weight", theirs + "input_layernorm.weight", False),
            (ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight", False),
            (ours + "self_attention.linear_proj.weight", theirs + "self_attn.o_proj.weight", False),
            (ours + "self_attention.q_layernorm.weight", theirs + "self_attn.q_norm.weight", False),
            (ours + "self_attention.k_layernorm.weight", theirs + "self_attn.k_norm.weight", False),
        ]
        if sparse:
            table.append((ours + "mlp.router.weight", theirs + "mlp.gate.weight", False))
        _copy(src, dst, table, to_megatron)
        qkv, names = f"{ours}self_attention.linear_qkv.weight", [f"{theirs}self_attn.{p}_proj.weight" for p in "qkv"]
        if to_megatron:
            dst[qkv] = fuse_qkv(*(src.pop(n) for n in names), groups)
        else:
            dst.update(zip(names, split_qkv(src.pop(qkv), heads, groups, head_dim)))
        if sparse:
            for ours_expert, theirs_expert in _expert_prefixes(model_args, i):
                _swiglu_mlp(src, dst, ours_expert, theirs_expert, to_megatron)
        else:
            _swiglu_mlp(src, dst, ours + "mlp.", theirs + "mlp.", to_megatron)


def _deepseek_v3_layers(src: _Tensors, dst: dict, model_args: dict, to_megatron: bool) -> None:
    """Per layer (transformers/models/deepseek_v3/modeling_deepseek_v3.py: DeepseekV3DecoderLayer) <->
    megatron-core's MLASelfAttention (transformer/multi_latent_attention.py) and MoELayer, all renames, no
    row reordering:

    - q_a_proj, q_a_layernorm, q_b_proj (or q_proj) <-> linear_q_down_proj, q_layernorm, linear_q_up_proj
      (linear_q_proj): per head [nope; rope] rows on both sides;
    - kv_a_proj_with_mqa ([latent; shared rotary key] rows), kv_a_layernorm, kv_b_proj (per head
      [key nope; value] rows) <-> linear_kv_down_proj, kv_layernorm, linear_kv_up_proj, the same orders;
    - the rotary rows stay interleaved: DeepSeek-V3's rope_interleave rotates pairs (x0, x1), (x2, x3), ...
      and megatron-core's MLA de-interleaves before rotate_half (rope_utils.py _apply_rotary_pos_emb_bshd),
      the same rotation with the same output order;
    - o_proj <-> linear_proj; gate.weight, gate.e_score_correction_bias <-> router.weight, router.expert_bias;
      experts.{e} <-> experts.local_experts.{e}; shared_experts <-> shared_experts (gate|up fused)."""
    for i, sparse in enumerate(moe_layer_pattern(model_args)):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        att, hf_att = ours + "self_attention.", theirs + "self_attn."
        table = [
            (ours + "input_layernorm.weight", theirs + "input_layernorm.weight", False),
            (ours + "pre_mlp_layernorm.weight", theirs + "post_attention_layernorm.weight", False),
            (att + "linear_proj.weight", hf_att + "o_proj.weight", False),
            (att + "linear_kv_down_proj.weight", hf_att + "kv_a_proj_with_mqa.weight", False),
            (att + "kv_layernorm.weight", hf_att + "kv_a_layernorm.weight", False),
            (att + "linear_kv_up_proj.weight", hf_att + "kv_b_proj.weight", False),
        ]
        if model_args["q_lora_rank"] is None:
            table.append((att + "linear_q_proj.weight", hf_att + "q_proj.weight", False))
        else:
            table.append((att + "linear_q_down_proj.weight", hf_att + "q_a_proj.weight", False))
            table.append((att + "q_layernorm.weight", hf_att + "q_a_layernorm.weight", False))
            table.append((att + "linear_q_up_proj.weight", hf_att + "q_b_proj.weight", False))
        if sparse:
            table.append((ours + "mlp.router.weight", theirs + "mlp.gate.weight", False))
        _copy(src, dst, table, to_megatron)
        if not sparse:
            _swiglu_mlp(src, dst, ours + "mlp.", theirs + "mlp.", to_megatron)
            continue
        bias, hf_bias = ours + "mlp.router.expert_bias", theirs + "mlp.gate.e_score_correction_bias"
        if to_megatron:
            dst[bias] = src.pop(hf_bias)
        elif model_args["moe_router_enable_expert_bias"]:
            dst[hf_bias] = src.pop(bias)
        else:  # no expert bias: DeepseekV3TopkRouter's zeros add nothing
            dst[hf_bias] = torch.zeros(model_args["num_experts"], dtype=torch.float32)
        for ours_expert, theirs_expert in _expert_prefixes(model_args, i):
            _swiglu_mlp(src, dst, ours_expert, theirs_expert, to_megatron)
        _swiglu_mlp(src, dst, ours + "mlp.shared_experts.", theirs + "mlp.shared_experts.", to_megatron)


# transformers 5's in-memory Qwen3MoeExperts (modeling_qwen3_moe.py): a layer's experts as two 3D
# tensors, gate_up_proj [E, 2 x moe_intermediate_size, hidden] (gate rows first) and down_proj
# [E, hidden, moe_intermediate_size]; its checkpoints and save_pretrained keep one Linear per expert
# (transformers/conversion_mapping.py: the qwen2_moe converters MergeModulelist + Concatenate).
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)")


def _unfused_experts(state_dict: dict) -> dict:
    """``state_dict`` with transformers' 3D expert tensors split into the per-expert names of a
    checkpoint file (model.layers.{i}.mlp.experts.{e}.gate_proj.weight, ...), as views."""
    out = {}
    for key, value in state_dict.items():
        fused = _FUSED_EXPERTS.fullmatch(key)
        if fused is None:
            out[key] = value
            continue
        prefix, kind = fused.groups()
        for e, weight in enumerate(value.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}{e}.down_proj.weight"] = weight
            else:
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = weight.chunk(2)
    return out


def _refuse_mtp_tensors(state_dict: dict, cfg) -> None:
    """DeepSeek-V3's multi-token prediction modules are stored as layers num_hidden_layers, ... (its
    num_nextn_predict_layers); DeepseekV3ForCausalLM neither builds nor reads them, and megatron-mfsdp refuses
    --mtp-num-layers: a checkpoint holding them is refused rather than converted in part. A config that only
    counts them, without the tensors, converts (the count is not carried: export writes 0)."""
    extra = sorted(
        k for k in state_dict if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= cfg.num_hidden_layers
    )
    if extra:
        _refuse(
            "num_nextn_predict_layers",
            getattr(cfg, "num_nextn_predict_layers", None),
            f"multi-token prediction modules ({extra[0]}, ...) are not converted: megatron-mfsdp refuses MTP",
        )


def _convert(src: _Tensors, model_args: dict, arch: str, to_megatron: bool) -> dict:
    """The whole state dict of one architecture, either way."""
    dst = {}
    ours = "embedding.word_embeddings.weight"
    theirs = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    embedding = src.pop(theirs if to_megatron else ours)
    if to_megatron:
        if embedding.shape[0] != model_args["vocab_size"]:
            _refuse("vocab_size", model_args["vocab_size"], f"{theirs} has {embedding.shape[0]} rows")
        dst[ours] = _pad_rows(embedding, model_args["padded_vocab_size"])
    else:
        dst[theirs] = embedding = embedding[: model_args["vocab_size"]].clone()
    if arch in ("llama", "qwen3_moe", "deepseek_v3"):
        layers = {"llama": _llama_layers, "qwen3_moe": _qwen3_moe_layers, "deepseek_v3": _deepseek_v3_layers}[arch]
        layers(src, dst, model_args, to_megatron)
        _copy(src, dst, [("decoder.final_layernorm.weight", "model.norm.weight", False)], to_megatron)
    else:
        _gpt2_layers(src, dst, model_args, to_megatron)
        _copy(src, dst, _GPT2_GLOBAL, to_megatron)
    _output_layer(src, dst, model_args, embedding, to_megatron)
    src.finish()
    return dst


# ----------------------------------------------------------------------------------------
# The converter's entry points
# ----------------------------------------------------------------------------------------


def hf_to_megatron(hf_state_dict: dict, hf_config, make_vocab_size_divisible_by: int = 128) -> tuple[dict, dict]:
    """(megatron state dict, model_args) of a LlamaForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM or
    DeepseekV3ForCausalLM checkpoint (MoE experts as the files store them, one Linear each, or as transformers
    holds them in memory, 3D); the vocabulary is padded to a multiple of ``make_vocab_size_divisible_by`` with
    zero rows."""
    cfg = _as_config(hf_config)
    if cfg.model_type == "llama":
        args = _llama_args(cfg, make_vocab_size_divisible_by)
    elif cfg.model_type == "qwen3_moe":
        args = _qwen3_moe_args(cfg, make_vocab_size_divisible_by)
        hf_state_dict = _unfused_experts(hf_state_dict)
    elif cfg.model_type == "deepseek_v3":
        args = _deepseek_v3_args(cfg, make_vocab_size_divisible_by)
        hf_state_dict = _unfused_experts(hf_state_dict)
        _refuse_mtp_tensors(hf_state_dict, cfg)
    elif cfg.model_type == "gpt2":
        args = _gpt2_args(cfg, make_vocab_size_divisible_by)
        # The original GPT-2 files name GPT2Model's tensors without the "transformer." prefix.
        hf_state_dict = {
            k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v for k, v in hf_state_dict.items()
        }
    else:
        _refuse(
            "model_type",
            cfg.model_type,
            "only llama (LlamaForCausalLM), gpt2 (GPT2LMHeadModel), qwen3_moe (Qwen3MoeForCausalLM) and "
            "deepseek_v3 (DeepseekV3ForCausalLM) convert",
        )
    src = _Tensors(hf_state_dict, f"Hugging Face {cfg.model_type} state dict", IGNORED[cfg.model_type])
    return _convert(src, args, cfg.model_type, to_megatron=True), args


def megatron_to_hf(state_dict: dict, model_args: dict, config_overrides: dict | None = None):
    """(HF state dict as save_pretrained writes it, HF config) of a whole GPTModel: DeepSeek-V3 when
    model_args has num_experts and multi_latent_attention, Qwen3-MoE with num_experts alone, else Llama when
    it has swiglu, else GPT-2 (``architecture``). ``config_overrides`` sets what megatron does not carry
    (bos_token_id, eos_token_id, ...). Padded vocabulary rows are sliced off."""
    args = _resolved(model_args)
    _refuse_unsupported(args)
    if args["vocab_size"] is None:
        raise ConversionError("model_args['vocab_size'] (the tokenizer's, unpadded) is needed to slice off padding")
    embedding = state_dict.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise ConversionError("megatron GPTModel state dict: tensor 'embedding.word_embeddings.weight' is missing")
    rows = embedding.shape[0]
    if model_args.get("padded_vocab_size") not in (None, rows) or rows < args["vocab_size"]:
        _refuse("padded_vocab_size", model_args.get("padded_vocab_size"), f"the embedding has {rows} rows")
    args["padded_vocab_size"] = rows
    arch = architecture(args)
    config = {
        "llama": _llama_config,
        "gpt2": _gpt2_config,
        "qwen3_moe": _qwen3_moe_config,
        "deepseek_v3": _deepseek_v3_config,
    }[arch](args)
    config.dtype = embedding.dtype  # what save_pretrained records: the dtype of the weights
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    src = _Tensors(state_dict, "megatron GPTModel state dict", IGNORED["megatron"])
    return _convert(src, args, arch, to_megatron=False), config


def load_into_model(model: torch.nn.Module, state_dict: dict) -> None:
    """Load a converted state dict into a whole (1 x 1 x 1) GPTModel: every parameter must be
    given and every tensor used (only megatron's empty ``_extra_state`` entries may be absent)."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ConversionError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------

WEIGHTS_FILE, INDEX_FILE, CONFIG_FILE = "model.safetensors", "model.safetensors.index.json", "config.json"


def save_hf_checkpoint(folder: str, hf_state_dict: dict, hf_config) -> None:
    """model.safetensors and config.json, as ``AutoModelForCausalLM.from_pretrained(folder)``
    reads them (a tied lm_head is left out, as save_pretrained does)."""
    from safetensors.torch import save_file

    config = _as_config(hf_config)
    tensors = {k: v.contiguous() for k, v in hf_state_dict.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    config.save_pretrained(folder)


def load_hf_checkpoint(folder: str) -> tuple[dict, object]:
    """(state dict, config) of a local safetensors checkpoint, one file or sharded by an index;
    never looks anything up on the hub."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    elif os.path.isfile(os.path.join(folder, INDEX_FILE)):
        with open(os.path.join(folder, INDEX_FILE)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        raise FileNotFoundError(f"{folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE} (only safetensors are read)")
    state_dict = {}
    for name in files:
        state_dict.update(load_file(os.path.join(folder, name)))
    return state_dict, config
