"""megatron-core GPT parameter names -> roles.

The names are megatron-core's (local and Transformer Engine layer specs). Embeddings, the output
layer, biases and norms are elementwise parameters; the four hidden matrices of every layer are
matrices. Which rule runs on each role is --optimizer's (the optimizer's registry), not the
model's: with --optimizer muon, Muon on the matrices and AdamW (or --muon-scalar-optimizer lion)
on the rest; with --optimizer adam, AdamW on all.
"""

from __future__ import annotations

from ...placement.classes import ELEMENTWISE, MATRIX

_TAIL_PATTERNS = (
    "*embedding*",
    "*output_layer.*",
    "*.bias",
    "*layer_norm_weight",  # TE: norm fused into the linear layer
    "*layer_norm_bias",
    "*norm*.weight",  # input/pre_mlp/final layernorm, q/k layernorm, RMSNorm
)
MATRIX_PATTERNS = ("*linear_qkv.weight", "*linear_proj.weight", "*linear_fc1.weight", "*linear_fc2.weight")


def gpt_param_roles() -> list[tuple[str, str]]:
    """The roles of a GPTModel's parameters, by name pattern; the first match wins."""
    return [(p, ELEMENTWISE) for p in _TAIL_PATTERNS] + [(p, MATRIX) for p in MATRIX_PATTERNS]


def qkv_split_rows(config) -> tuple[int, int, int]:
    """Rows per query group of Q, K and V in megatron-core's linear_qkv weight."""
    heads_per_group = config.num_attention_heads // config.num_query_groups
    return (heads_per_group * config.kv_channels, config.kv_channels, config.kv_channels)
