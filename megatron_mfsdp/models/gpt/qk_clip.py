"""QK-clip's model knowledge (MuonClip, Kimi K2: arXiv 2507.20534): each attention head's largest
pre-softmax logit of a step, and which rows of ``linear_qkv`` belong to which head.

megatron-core's rule (SelfAttention.clip_qk, transformer/attention.py at core_v0.16.1): a query
group's eta is min(1, threshold / the largest max logit of its heads); its query rows are scaled by
eta^alpha and its key rows by eta^(1 - alpha), its value rows left alone. A TP rank holds whole query
groups, so each rank clips its own heads. Biases are not scaled (as megatron-core's), and the max
logit is tracked as Transformer Engine's attention tracks it (``current_max_attn_logits``: a running
max over the step's forward passes, one value per local head).
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
    """The model chunk's self-attention modules that track max logits, in layer order."""
    return [m for m in module.modules() if hasattr(m, "linear_qkv") and hasattr(m, "core_attention")]


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
