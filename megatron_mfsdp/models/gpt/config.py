"""From Megatron-LM arguments (a parsed pretrain_gpt.py namespace, or the architecture fields
a checkpoint or a Hugging Face config carries, under the same dests) to megatron-core's
TransformerConfig and GPTModel keyword arguments.

Like Megatron-LM's core_transformer_config_from_args (megatron/training/arguments.py at
core_v0.16.1), every argument named as a TransformerConfig field is copied, then the few
that Megatron-LM derives are set. One departure: --openai-gelu selects the tanh GELU for the
megatron-core model (Megatron-LM 0.16.1 applies it to its legacy models only), which GPT-2
checkpoints need.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

# The architecture fields a checkpoint carries so that loading it needs no model flags.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "max_position_embeddings",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "rotary_seq_len_interpolation_factor",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "layernorm_epsilon",
    "layernorm_zero_centered_gamma",
    "qk_layernorm",
    "add_bias_linear",
    "add_qkv_bias",
    "swiglu",
    "openai_gelu",
    "squared_relu",
    "untie_embeddings_and_output_weights",
    "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32",
    "fp32_residual_connection",
    "init_method_std",
    "padded_vocab_size",
    "seq_length",
)


def architecture(args) -> dict:
    """The architecture fields of ``args`` (a namespace or a dict), for checkpoints and converters."""
    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    return {k: get(k) for k in ARCHITECTURE_FIELDS if get(k) is not None}


def _activation(args) -> dict:
    import torch.nn.functional as F

    if args.swiglu:
        return dict(
            activation_func=F.silu,
            gated_linear_unit=True,
            bias_activation_fusion=getattr(args, "bias_swiglu_fusion", False) and args.add_bias_linear,
        )
    fused = getattr(args, "bias_gelu_fusion", False) and args.add_bias_linear
    if getattr(args, "squared_relu", False):
        from megatron.core.activations import squared_relu

        return dict(activation_func=squared_relu, bias_activation_fusion=False)
    if getattr(args, "openai_gelu", False):
        from megatron.core.transformer.utils import openai_gelu

        return dict(activation_func=openai_gelu, bias_activation_fusion=False)
    return dict(activation_func=F.gelu, bias_activation_fusion=fused)


def transformer_config_from_args(args):
    """megatron-core's TransformerConfig from Megatron-LM arguments."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = SimpleNamespace(**args) if isinstance(args, dict) else args
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    dtype = (
        torch.bfloat16
        if getattr(args, "bf16", False)
        else torch.float16
        if getattr(args, "fp16", False)
        else torch.float32
    )
    kw.update(
        _activation(args),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        batch_p2p_comm=not getattr(args, "overlap_p2p_comm", True),
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        use_cpu_initialization=getattr(args, "use_cpu_initialization", False) or not torch.cuda.is_available(),
        deallocate_pipeline_outputs=True,
    )
    if isinstance(kw.get("attention_backend"), str):
        kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
    for unset in ("fp8", "fp8_param"):  # FP8 is the owner's job (precision/), not megatron's
        kw.pop(unset, None)
    return TransformerConfig(**kw)


def gpt_model_kwargs(args) -> dict:
    """GPTModel's own keyword arguments (position embeddings, tied output layer)."""
    args = SimpleNamespace(**args) if isinstance(args, dict) else args
    return dict(
        position_embedding_type=args.position_embedding_type,
        rotary_percent=getattr(args, "rotary_percent", 1.0),
        rotary_base=getattr(args, "rotary_base", 10000),
        rope_scaling=getattr(args, "use_rope_scaling", False),
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
    )
