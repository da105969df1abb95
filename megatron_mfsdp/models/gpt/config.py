"""From Megatron-LM's argument dests to megatron-core's TransformerConfig and GPTModel keyword
arguments. The input is a mapping of dests to values: the form a checkpoint stores them in (its
``args`` entry), hf.py's ``model_args``, and what training/configs.py hands over from a parsed
pretrain_gpt.py namespace (``vars(args)``); the namespace itself stays in training/.

Like Megatron-LM's core_transformer_config_from_args (megatron/training/arguments.py at
core_v0.16.1), the config class is MLATransformerConfig with --multi-latent-attention (else
TransformerConfig), every dest named as one of its fields is copied (an unset --rope-type left to the
class's default: yarn for MLA), then the few that Megatron-LM derives are set (``num_experts`` is
megatron-core's ``num_moe_experts``). One
departure: --openai-gelu selects the tanh GELU for the
megatron-core model (Megatron-LM 0.16.1 applies it to its legacy models only), which GPT-2
checkpoints need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


def moe_layer_pattern(dests: Mapping) -> list[bool]:
    """Which layers are MoE layers: --moe-layer-freq N (layers 0, N, 2N, ...) or a 0/1 list, as megatron-core's
    get_gpt_decoder_block_spec reads it (models/gpt/gpt_layer_specs.py at core_v0.16.1); none without
    --num-experts. The one reading of the flag (the log's MoE counts, tools/plan.py, hf.py)."""
    layers = dests["num_layers"]
    if not dests.get("num_experts"):
        return [False] * layers
    freq = dests.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    if len(freq) != layers:
        raise ValueError(f"moe_layer_freq {freq}: one entry per layer is needed (num_layers={layers})")
    return [bool(f) for f in freq]


def _activation(dests: Mapping) -> dict:
    import torch.nn.functional as F

    if dests["swiglu"]:
        return dict(
            activation_func=F.silu,
            gated_linear_unit=True,
            bias_activation_fusion=dests.get("bias_swiglu_fusion", False) and dests["add_bias_linear"],
        )
    fused = dests.get("bias_gelu_fusion", False) and dests["add_bias_linear"]
    if dests.get("squared_relu", False):
        from megatron.core.activations import squared_relu

        return dict(activation_func=squared_relu, bias_activation_fusion=False)
    if dests.get("openai_gelu", False):
        from megatron.core.transformer.utils import openai_gelu

        return dict(activation_func=openai_gelu, bias_activation_fusion=False)
    return dict(activation_func=F.gelu, bias_activation_fusion=fused)


# Our --yarn-* flags (training/arguments/model_flags.py) -> MLATransformerConfig's fields of the same meaning.
MLA_YARN_FIELDS = {
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def mla_yarn_fields(dests: Mapping) -> dict:
    """The --yarn-* settings given (not None) as MLATransformerConfig fields; unset ones keep its defaults."""
    return {field: dests[dest] for dest, field in MLA_YARN_FIELDS.items() if dests.get(dest) is not None}


def transformer_config(dests: Mapping):
    """megatron-core's TransformerConfig of Megatron-LM argument dests (a checkpoint's stored args, a
    model_args dict, or a run's ``vars(args)``: training/configs.py transformer_config_from_args)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    config_class = MLATransformerConfig if dests.get("multi_latent_attention", False) else TransformerConfig
    kw = {f.name: dests[f.name] for f in dataclasses.fields(config_class) if f.name in dests}
    if kw.get("rope_type", "") is None:  # --rope-type unset: the config class's default (MLA's is yarn)
        kw.pop("rope_type")
    if config_class is MLATransformerConfig:
        kw.update(mla_yarn_fields(dests))
    dtype = torch.bfloat16 if dests.get("bf16", False) else torch.float16 if dests.get("fp16", False) else torch.float32
    kw.update(
        _activation(dests),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        num_query_groups=dests["num_query_groups"] if dests.get("group_query_attention", False) else None,
        num_moe_experts=dests.get("num_experts") or None,
        batch_p2p_comm=not dests.get("overlap_p2p_comm", True),
        num_layers_in_first_pipeline_stage=dests.get("decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=dests.get("decoder_last_pipeline_num_layers", None),
        use_cpu_initialization=dests.get("use_cpu_initialization", False) or not torch.cuda.is_available(),
        deallocate_pipeline_outputs=True,
    )
    if isinstance(kw.get("attention_backend"), str):
        kw["attention_backend"] = AttnBackend[kw["attention_backend"]]
    for unset in ("fp8", "fp8_param"):  # FP8 is the owner's job (precision/), not megatron's
        kw.pop(unset, None)
    return config_class(**kw)


def gpt_model_kwargs(dests: Mapping) -> dict:
    """GPTModel's own keyword arguments (position embeddings, tied output layer) of Megatron-LM
    argument dests."""
    return dict(
        position_embedding_type=dests["position_embedding_type"],
        rotary_percent=dests.get("rotary_percent", 1.0),
        rotary_base=dests.get("rotary_base", 10000),
        rope_scaling=dests.get("use_rope_scaling", False),
        rope_scaling_factor=dests.get("rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=dests.get("rotary_seq_len_interpolation_factor", None),
        share_embeddings_and_output_weights=not dests.get("untie_embeddings_and_output_weights", False),
    )
