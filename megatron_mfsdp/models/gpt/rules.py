"""megatron-core GPT parameter names -> update rules.

The names are megatron-core's (local and Transformer Engine layer specs). Embeddings,
the output layer, biases and norms take the elementwise rule; the four hidden
matrices of every layer take ``matrix_rule`` (Muon, or AdamW with --optimizer adam).
"""

from __future__ import annotations

ELEMENTWISE_RULE = "adamw"

_TAIL_PATTERNS = (
    "*embedding*",
    "*output_layer.*",
    "*.bias",
    "*layer_norm_weight",  # TE: norm fused into the linear layer
    "*layer_norm_bias",
    "*norm*.weight",  # input/pre_mlp/final layernorm, q/k layernorm, RMSNorm
)
MATRIX_PATTERNS = ("*linear_qkv.weight", "*linear_proj.weight", "*linear_fc1.weight", "*linear_fc2.weight")


def gpt_param_rules(matrix_rule: str) -> list[tuple[str, str]]:
    """The default rule list of a GPTModel; the first match wins."""
    return [(p, ELEMENTWISE_RULE) for p in _TAIL_PATTERNS] + [(p, matrix_rule) for p in MATRIX_PATTERNS]


def qkv_split_rows(config) -> tuple[int, int, int]:
    """Rows per query group of Q, K and V in megatron-core's linear_qkv weight."""
    heads_per_group = config.num_attention_heads // config.num_query_groups
    return (heads_per_group * config.kv_channels, config.kv_channels, config.kv_channels)
