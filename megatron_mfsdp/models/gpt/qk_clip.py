"""QK-clip's model knowledge (MuonClip, Kimi K2: arXiv 2507.20534): each attention head's largest
pre-softmax logit of a step, and which rows of ``linear_qkv`` belong to which head.

megatron-core's rule (SelfAttention.clip_qk, transformer/attention.py at core_v0.16.1): a query
group's eta is min(1, threshold / the largest max logit of its heads); its query rows are scaled by
eta^alpha and its key rows by eta^(1 - alpha), its value rows left alone. A TP rank holds whole query
groups, so each rank clips its own heads. Biases are not scaled (as megatron-core's), and the max
logit is tracked as Transformer Engine's attention tracks it (``current_max_attn_logits``: a running
max over the step's forward passes, one value per local head).

Multi-latent attention (MLASelfAttention.clip_qk, transformer/multi_latent_attention.py at core_v0.16.1) clips
per head: eta = min(1, threshold / the head's max logit); in the query projection (linear_q_proj, or
linear_q_up_proj after the query latent's norm) each head's no-position rows are scaled by eta^alpha and its
rotary rows by eta; in linear_kv_up_proj each head's key rows by eta^(1 - alpha), its value rows left alone; the
rotary key that all heads share (in linear_kv_down_proj) is left alone. A head's logit q_nope.k_nope + q_pe.k_pe
then scales by eta (the norms act on the latents, before the scaled up projections).
"""

from __future__ import annotations

import torch

MAX_LOGITS = "current_max_attn_logits"
"""The core attention's attribute (megatron-core's TEDotProductAttention sets the same one)."""


@torch.no_grad()
def record_max_logits(core_attention, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> None:
    """Fold this forward's largest logit per head into ``core_attention``'s running max. ``q`` and ``k``
    are [b, heads, s, d] (keys already repeated per query head); positions a causal mask hides do not
    count."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # SDPA's is_causal: the upper-left triangle
        sq, sk = logits.shape[-2], logits.shape[-1]
        hidden = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(1)
        logits = logits.masked_fill(hidden, float("-inf"))
    batch_max = logits.amax(dim=(0, 2, 3))
    current = getattr(core_attention, MAX_LOGITS, None)
    setattr(core_attention, MAX_LOGITS, batch_max if current is None else torch.maximum(current, batch_max))


def self_attentions(module: torch.nn.Module) -> list:
    """The model chunk's self-attention modules that track max logits (SelfAttention's linear_qkv, or MLA's
    linear_kv_up_proj), in layer order."""
    projections = ("linear_qkv", "linear_kv_up_proj")
    return [m for m in module.modules() if hasattr(m, "core_attention") and any(hasattr(m, p) for p in projections)]


def clipped_weights(attention, max_logits: torch.Tensor, threshold: float, alpha: float) -> list:
    """(weight parameter, its row multipliers) of one self-attention's clip at these max logits (its local
    heads'), empty when no head passed the threshold: linear_qkv's rows (per query group), or for multi-latent
    attention its query projection's and linear_kv_up_proj's rows (per head)."""
    if hasattr(attention, "linear_qkv"):
        groups = attention.num_query_groups_per_partition
        etas = group_etas(max_logits, groups, threshold)
        if not bool((etas < 1).any()):
            return []
        heads = attention.num_attention_heads_per_partition // groups
        rows = qkv_row_scales(etas, heads, attention.hidden_size_per_attention_head, alpha)
        return [(attention.linear_qkv.weight, rows)]
    etas = group_etas(max_logits, attention.num_attention_heads_per_partition, threshold)
    if not bool((etas < 1).any()):
        return []
    config = attention.config
    q_rows, kv_rows = mla_row_scales(etas, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim, alpha)
    q_proj = attention.linear_q_proj if config.q_lora_rank is None else attention.linear_q_up_proj
    return [(q_proj.weight, q_rows), (attention.linear_kv_up_proj.weight, kv_rows)]


def group_etas(max_logits: torch.Tensor, groups: int, threshold: float) -> torch.Tensor:
    """megatron-core's GQA rule: per query group, min(1, threshold / its heads' largest max logit)."""
    worst = max_logits.view(groups, -1).amax(dim=1)
    return torch.clamp(threshold / worst, max=1.0)


def qkv_row_scales(etas: torch.Tensor, heads_per_group: int, head_dim: int, alpha: float) -> torch.Tensor:
    """The multiplier of every row of a TP-local ``linear_qkv`` weight, whose rows are, per query group,
    its query heads, its key head and its value head (megatron-core's interleaved layout): eta^alpha on
    query rows, eta^(1 - alpha) on key rows, 1 on value rows. fp32, one entry per row."""
    etas = etas.double()
    q = etas.pow(alpha)[:, None].expand(-1, heads_per_group * head_dim)
    k = etas.pow(1 - alpha)[:, None].expand(-1, head_dim)
    v = torch.ones(len(etas), head_dim, dtype=torch.float64)
    return torch.cat([q, k, v], dim=1).reshape(-1).float()


def mla_row_scales(
    etas: torch.Tensor, qk_head_dim: int, qk_pos_emb_head_dim: int, v_head_dim: int, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The multipliers of every row of MLA's TP-local query projection (per head: qk_head_dim no-position rows
    x eta^alpha, then qk_pos_emb_head_dim rotary rows x eta) and of its linear_kv_up_proj (per head: qk_head_dim
    key rows x eta^(1 - alpha), then v_head_dim value rows x 1), ``etas`` one per local head. float64: the
    fp32 master's multiply (MatrixFSDPOptimizer.scale_rows) rounds once."""
    etas = etas.double()[:, None]
    q = torch.cat([etas.pow(alpha).expand(-1, qk_head_dim), etas.expand(-1, qk_pos_emb_head_dim)], dim=1)
    k = etas.pow(1 - alpha).expand(-1, qk_head_dim)
    kv = torch.cat([k, torch.ones(len(etas), v_head_dim, dtype=torch.float64)], dim=1)
    return q.reshape(-1), kv.reshape(-1)
