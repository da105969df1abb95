"""QK-clip's formula (models/gpt/qk_clip.py) against float64 references and megatron-core's own
SelfAttention._clip_linear_qkv, and the max logits our CPU attention records."""

import types

import pytest
import torch

from megatron_mfsdp.models.gpt import qk_clip as qk

HIDDEN, HEAD_DIM = 32, 8


def _logits(w: torch.Tensor, x: torch.Tensor, groups: int, heads: int) -> torch.Tensor:
    """[heads, s, s] pre-softmax logits (scale 1/sqrt(d)) of ``x`` [s, hidden] through a linear_qkv weight in
    megatron-core's layout (per query group: its query heads, its key head, its value head), float64."""
    per = heads // groups
    qkv = (x.double() @ w.double().T).view(x.shape[0], groups, per + 2, HEAD_DIM)
    q = qkv[:, :, :per].reshape(x.shape[0], heads, HEAD_DIM)
    k = qkv[:, :, per].repeat_interleave(per, dim=1)
    return torch.einsum("shd,thd->hst", q, k) / HEAD_DIM**0.5


@pytest.mark.parametrize("groups,heads", [(4, 4), (2, 4), (1, 4)])  # MHA, GQA, MQA
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_clip_brings_each_groups_worst_head_to_the_threshold_and_matches_megatron_core(groups, heads, alpha):
    torch.manual_seed(groups * 10 + heads)
    w = torch.randn(groups * (heads // groups + 2) * HEAD_DIM, HIDDEN) * 2
    x = torch.randn(16, HIDDEN)
    max_logits = _logits(w, x, groups, heads).amax(dim=(1, 2))
    threshold = float(max_logits.median())
    etas = qk.group_etas(max_logits.float(), groups, threshold)
    scales = qk.qkv_row_scales(etas, heads // groups, HEAD_DIM, alpha)
    clipped = w * scales[:, None]
    after = _logits(clipped, x, groups, heads).amax(dim=(1, 2)).view(groups, -1)
    before = max_logits.view(groups, -1).amax(dim=1)
    for g in range(groups):  # a group past the threshold ends with its worst head at it; the others unchanged
        expected = min(float(before[g]), threshold)
        assert float(after[g].max()) == pytest.approx(expected, rel=1e-6), (g, after[g], before[g])
    assert (etas < 1).any() and (etas == 1).any() or groups == 1
    # megatron-core's own clip of the same weight with the same etas (transformer/attention.py at 0.16.1)
    from megatron.core.transformer.attention import SelfAttention

    fake = types.SimpleNamespace(
        num_query_groups_per_partition=groups,
        query_projection_size=heads * HEAD_DIM,
        kv_projection_size=groups * HEAD_DIM,
        qk_clip_balancing_eta=etas.view(groups, 1, 1),
        config=types.SimpleNamespace(qk_clip_alpha=alpha),
    )
    theirs = SelfAttention._clip_linear_qkv(fake, w.clone())
    torch.testing.assert_close(clipped, theirs, rtol=1e-6, atol=0)


def test_a_wrong_row_layout_is_caught():
    """Negative control: the multipliers one head off (the value head's 1 on a query head) miss the threshold."""
    torch.manual_seed(0)
    groups, heads = 2, 4
    w = torch.randn(groups * (heads // groups + 2) * HEAD_DIM, HIDDEN) * 2
    x = torch.randn(16, HIDDEN)
    max_logits = _logits(w, x, groups, heads).amax(dim=(1, 2))
    threshold = float(max_logits.min()) / 2
    etas = qk.group_etas(max_logits.float(), groups, threshold)
    right = qk.qkv_row_scales(etas, heads // groups, HEAD_DIM, 0.5)
    wrong = torch.roll(right.view(groups, -1), shifts=2 * HEAD_DIM, dims=1).reshape(-1)
    assert float(_logits(w * right[:, None], x, groups, heads).amax()) == pytest.approx(threshold, rel=1e-6)
    after = _logits(w * wrong[:, None], x, groups, heads).amax(dim=(1, 2))
    assert float(after.max()) > threshold * 1.1


def test_recorded_max_logits_are_the_causal_maximum_per_head():
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 6, HEAD_DIM), torch.randn(2, 4, 6, HEAD_DIM)
    holder = types.SimpleNamespace()
    scale = HEAD_DIM**-0.5
    qk.record_max_logits(holder, q, k, scale, causal=True)
    logits = torch.einsum("bhsd,bhtd->bhst", q.double(), k.double()) * scale
    causal = logits.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(
        getattr(holder, qk.MAX_LOGITS).double(), causal.amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6
    )
    assert (getattr(holder, qk.MAX_LOGITS).double() < logits.amax(dim=(0, 2, 3))).any()  # the mask matters here
    qk.record_max_logits(holder, q * 3, k, scale, causal=True)  # a running max over the step's passes
    torch.testing.assert_close(
        getattr(holder, qk.MAX_LOGITS).double(),
        3 * causal.amax(dim=(0, 2, 3)).clamp(min=0) + causal.amax(dim=(0, 2, 3)).clamp(max=0),
        rtol=1e-5,
        atol=1e-5,
    )
