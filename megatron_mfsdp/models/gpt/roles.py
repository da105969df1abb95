"""megatron-core GPT parameter names -> roles.

The names are megatron-core's (local and Transformer Engine layer specs). Embeddings, the output
layer, biases and norms are elementwise parameters; the four hidden matrices of every layer are
matrices. In a mixture-of-experts layer each expert's ``linear_fc1``/``linear_fc2`` (SequentialMLP's
``mlp.experts.local_experts.{i}.linear_fc*.weight``, TEGroupedMLP's ``mlp.experts.linear_fc*.weight{i}``)
is a matrix of its own, as are the shared experts' and the router's weight; the shared-expert gate
(one row) and every bias are elementwise. The router's aux-loss-free ``expert_bias`` is a buffer, not
a parameter: every rank updates it alike from the all-reduced token counts.
Multi-latent attention's projections (``linear_q_proj``, or ``linear_q_down_proj`` and ``linear_q_up_proj``;
``linear_kv_down_proj``, ``linear_kv_up_proj``; ``linear_proj``) are matrices, each whole (Muon orthogonalizes
each as one matrix, as megatron-core's Muon does: its QKV split applies to ``linear_qkv`` only); its
``q_layernorm`` and ``kv_layernorm`` (on the latents) are norms.
Which rule runs on each role is --optimizer's (the optimizer's registry), not the
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
    "*.bias[0-9]*",  # TEGroupedMLP: one bias{i} per local expert
    "*shared_experts.gate_weight",  # --moe-shared-expert-gate: a [1, hidden] gate
)
MATRIX_PATTERNS = (
    "*linear_qkv.weight",
    "*linear_proj.weight",
    "*linear_fc1.weight",
    "*linear_fc2.weight",
    "*linear_fc1.weight[0-9]*",  # TEGroupedMLP: one weight{i} per local expert
    "*linear_fc2.weight[0-9]*",
    "*mlp.router.weight",
    # multi-latent attention (MLASelfAttention): each projection a whole matrix of its own, not split per head
    "*linear_q_proj.weight",
    "*linear_q_down_proj.weight",
    "*linear_q_up_proj.weight",
    "*linear_kv_down_proj.weight",
    "*linear_kv_up_proj.weight",
)


def gpt_param_roles() -> list[tuple[str, str]]:
    """The roles of a GPTModel's parameters, by name pattern; the first match wins."""
    return [(p, ELEMENTWISE) for p in _TAIL_PATTERNS] + [(p, MATRIX) for p in MATRIX_PATTERNS]


def qkv_split_rows(config) -> tuple[int, int, int]:
    """Rows per query group of Q, K and V in megatron-core's linear_qkv weight."""
    heads_per_group = config.num_attention_heads // config.num_query_groups
    return (heads_per_group * config.kv_channels, config.kv_channels, config.kv_channels)
