"""Multi-latent attention on the local spec (models/gpt/build.py, mla.py) and its QK-clip rule
(models/gpt/qk_clip.py) against megatron-core's own MLASelfAttention.clip_qk on a real CPU-built module."""

import pytest
import torch

from megatron_mfsdp.models.gpt import qk_clip as qk
from megatron_mfsdp.testing.tiny import init_megatron

SEQ, BATCH, HIDDEN, HEADS = 12, 2, 32, 4
QK, PE, V = 8, 4, 6  # qk_head_dim, qk_pos_emb_head_dim, v_head_dim: query/key heads 12 wide, values 6


@pytest.fixture(scope="module", autouse=True)
def megatron_state(tmp_path_factory):
    """megatron-core's modules read parallel_state: one gloo rank, in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    own = not dist.is_initialized()
    if own:
        init_file = tmp_path_factory.mktemp("dist") / "init"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    init_megatron()
    yield
    parallel_state.destroy_model_parallel()
    if own:
        dist.destroy_process_group()


def _config(q_lora_rank, **overrides):
    from megatron_mfsdp.models.gpt.config import transformer_config

    dests = dict(
        num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=64, num_attention_heads=HEADS, num_query_groups=1,
        group_query_attention=False, swiglu=False, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=10, qk_head_dim=QK,
        qk_pos_emb_head_dim=PE, v_head_dim=V, rope_type=None, rotary_scaling_factor=1.0, mscale=1.0,
        mscale_all_dim=0.0, qk_layernorm=True, normalization="RMSNorm", apply_rope_fusion=False, qk_clip=True,
        qk_clip_threshold=100.0, qk_clip_alpha=0.5, masked_softmax_fusion=False, bias_dropout_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    dests.update(overrides)
    return transformer_config(dests)


def _attention(q_lora_rank, **overrides):
    """A GPTModel's MLASelfAttention, built through our builder, its weights drawn large enough that logits
    are tens; and the model."""
    from megatron_mfsdp.models.gpt.build import build_gpt_model

    config = _config(q_lora_rank, **overrides)
    model = build_gpt_model(config, 64, SEQ, position_embedding_type="rope")
    g = torch.Generator().manual_seed(7 + (q_lora_rank or 0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embedding" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.6)
    return model.decoder.layers[0].self_attention, model


def _logits(attention, x):
    """[heads] max pre-softmax logits (causal) of ``attention`` at hidden states ``x`` [s, b, h], computed in
    float64 from the query and key megatron-core hands its core attention."""
    seen = {}

    def grab(module, args, kwargs):
        seen["q"], seen["k"] = args[0], args[1]

    from megatron_mfsdp.compat.cpu import cuda_on_cpu

    handle = attention.core_attention.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad(), cuda_on_cpu():
        attention(x, None)
    handle.remove()
    q, k = seen["q"].double(), seen["k"].double()  # [s, b, heads, q/k head dim]
    logits = torch.einsum("sbhd,tbhd->bhst", q, k) * attention.core_attention.softmax_scale
    hidden = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    return logits.masked_fill(hidden, float("-inf")).amax(dim=(0, 2, 3))


def test_mla_builds_on_the_local_spec_with_megatron_cores_shapes_and_scale():
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_mfsdp.models.gpt.mla import attention_shapes

    for q_lora_rank in (None, 16):
        attention, model = _attention(q_lora_rank)
        assert isinstance(attention, MLASelfAttention)
        assert attention.core_attention.softmax_scale == pytest.approx((QK + PE) ** -0.5)  # yarn at factor 1
        dests = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, qk_head_dim=QK, qk_pos_emb_head_dim=PE,
                     v_head_dim=V, q_lora_rank=q_lora_rank, kv_lora_rank=10, add_bias_linear=False,
                     qk_layernorm=True, normalization="RMSNorm")  # fmt: skip
        built = [(n, tuple(p.shape)) for n, p in attention.named_parameters()]
        assert built == attention_shapes(dests, 1)
        x = torch.randn(SEQ, BATCH, HIDDEN)
        from megatron_mfsdp.compat.cpu import cuda_on_cpu

        with cuda_on_cpu():
            out, _ = attention(x, None)
        assert out.shape == (SEQ, BATCH, HIDDEN) and torch.isfinite(out).all()
    # megatron-core's YaRN factor: softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(q/k head dim)
    attention, _ = _attention(16, rotary_scaling_factor=4.0, mscale_all_dim=0.7)
    mscale = 0.1 * 0.7 * torch.tensor(4.0).log().item() + 1.0
    assert attention.core_attention.softmax_scale == pytest.approx(mscale**2 / (QK + PE) ** 0.5)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_mla_clip_equals_megatron_cores_clip_qk_and_brings_each_head_to_the_threshold(q_lora_rank, alpha):
    attention, model = _attention(q_lora_rank, qk_clip_alpha=alpha)
    model.double()
    torch.manual_seed(3)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    before = _logits(attention, x)
    threshold = float(before.median())
    assert (before > threshold).any() and (before < threshold).any()
    clipped = qk.clipped_weights(attention, before, threshold, alpha)
    q_proj = attention.linear_q_proj if q_lora_rank is None else attention.linear_q_up_proj
    assert [w is q for (w, _), q in zip(clipped, (q_proj.weight, attention.linear_kv_up_proj.weight))] == [True] * 2
    ours = [w.detach() * rows.double()[:, None] for w, rows in clipped]
    # megatron-core's own clip of the same weights at the same max logits (multi_latent_attention.py at 0.16.1)
    theirs, their_model = _attention(q_lora_rank, qk_clip_alpha=alpha, qk_clip_threshold=threshold)  # same draw
    their_model.double()
    theirs.core_attention.current_max_attn_logits = before.clone()
    theirs.clip_qk()
    their_q = theirs.linear_q_proj if q_lora_rank is None else theirs.linear_q_up_proj
    torch.testing.assert_close(ours[0], their_q.weight.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(ours[1], theirs.linear_kv_up_proj.weight.detach(), rtol=1e-12, atol=0)
    # after the clip, with the same inputs: each head past the threshold at it, the others unchanged (float64)
    with torch.no_grad():
        for (w, _), new in zip(clipped, ours):
            w.copy_(new)
    after = _logits(attention, x)
    torch.testing.assert_close(after, torch.clamp(before, max=threshold), rtol=1e-10, atol=0)


def test_the_rotary_rows_need_their_own_eta():
    """Negative control: the query's rotary rows scaled as its no-position rows (eta^alpha, the linear_qkv rule)
    leave the clipped heads above the threshold."""
    attention, model = _attention(16)
    model.double()
    torch.manual_seed(4)
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    before = _logits(attention, x)
    threshold = float(before.min()) / 2
    etas = qk.group_etas(before, HEADS, threshold)
    q_rows, kv_rows = qk.mla_row_scales(etas, QK, PE + 0, V, 0.5)
    wrong = etas.double().pow(0.5)[:, None].expand(-1, QK + PE).reshape(-1)
    with torch.no_grad():
        attention.linear_q_up_proj.weight.mul_(wrong[:, None])
        attention.linear_kv_up_proj.weight.mul_(kv_rows.double()[:, None])
    after = _logits(attention, x)
    print(f"\nrotary rows at eta^alpha: worst head at {float((after / threshold).max()):.3f} x the threshold")
    assert float((after / threshold).max()) > 1.01, after / threshold


def test_yarn_flags_set_mla_config_fields_and_unset_ones_keep_its_defaults():
    """--yarn-beta-fast, --yarn-beta-slow, --yarn-original-max-position-embeddings (Megatron-LM HEAD's names)
    reach MLATransformerConfig's beta_fast, beta_slow, original_max_position_embeddings."""
    given = _config(None, yarn_beta_fast=1.0, yarn_beta_slow=2.0, yarn_original_max_position_embeddings=64)
    assert (given.beta_fast, given.beta_slow, given.original_max_position_embeddings) == (1.0, 2.0, 64)
    unset = _config(None, yarn_beta_fast=None, yarn_beta_slow=None, yarn_original_max_position_embeddings=None)
    assert (unset.beta_fast, unset.beta_slow, unset.original_max_position_embeddings) == (32, 1, 4096)
