"""transformer_engine.pytorch of the stand-in: DotProductAttention computes; any other name is an empty class
(megatron-core subclasses TE's layers at import time; the tests build none of them)."""

import torch

from . import fp8  # noqa: F401


class DotProductAttention(torch.nn.Module):
    """TE's attention for the sbhd layout and the causal or no mask, with ``return_max_logit``."""

    def __init__(self, num_attention_heads, kv_channels, attention_dropout=0.0, attn_mask_type="causal", **kwargs):
        super().__init__()
        self.heads, self.mask = num_attention_heads, attn_mask_type
        head_dim = kv_channels[0] if isinstance(kv_channels, tuple) else kv_channels
        self.scale = kwargs.get("softmax_scale") or head_dim**-0.5
        self.return_max_logit = kwargs.get("return_max_logit", False)
        self.calls = 0

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, **kwargs):
        """[s, b, h, d] in; [s, b, h * d_v] out (and [h] max logits)."""
        self.calls += 1
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves its group
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        logits = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if (attn_mask_type or self.mask) == "causal":
            hidden = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).triu(1)
            logits = logits.masked_fill(hidden, float("-inf"))
        out = torch.matmul(torch.softmax(logits, dim=-1), v)  # [b, h, s, d_v]
        out = out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
        if self.return_max_logit:
            return out, logits.detach().amax(dim=(0, 2, 3))
        return out


class _Placeholder(type(torch.nn.Module)):
    """A class whose attributes are placeholder classes too (``te.pytorch.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (torch.nn.Module,), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (torch.nn.Module,), {})
