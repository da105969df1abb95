"""DeepseekV3ForCausalLM <-> megatron-core GPTModel with multi-latent attention and MoE layers
(models/gpt/hf.py), on tiny random models built from configs (nothing from the hub), fp32, one process:

- HF -> ours -> HF is bitwise against what save_pretrained writes (one Linear per expert) and the config
  comes back equal; ours -> HF -> ours is bitwise; transformers' in-memory 3D experts convert as the files do;
- our GPTModel (MLASelfAttention with q_layernorm/kv_layernorm, a dense first layer, MoELayer with a shared
  expert, sigmoid routing with the expert bias, group-limited top-2, a top-k scaling factor) gives
  transformers' logits within 1e-5, with default RoPE and with YaRN (factor 4, mscale_all_dim 1);
- negative controls: on import, kv_b_proj's key/value rows swapped, the rotary rows de-interleaved, the
  e_score_correction_bias dropped, the shared expert's gate/up swapped move the logits far past that
  tolerance; on export, the converter patched wrong fails the round trip;
- settings either side cannot express are refused by name.
``pytest -s`` prints the measured deltas.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.models.gpt import hf  # noqa: E402
from megatron_mfsdp.models.gpt.hf import ConversionError, hf_to_megatron, megatron_to_hf  # noqa: E402
from tests.unit.test_hf import STD, megatron_state, our_logits  # noqa: E402, F401
from tests.unit.test_hf_moe import NOT_CARRIED, saved_tensors, unequal  # noqa: E402

TOL = 1e-5  # max |logits ours - transformers| in fp32
CONTROL_MIN = 1e-3  # a wrong mapping must move the logits at least 100 x TOL
BATCH, SEQ = 2, 24

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=100,  # padded to 128 on our side
    hidden_size=64,
    intermediate_size=96,  # the dense first layer
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    "rope_q_lora_groups": dict(DEEPSEEK_V3),
    # Kimi K2 / Moonlight style: one group, no q low rank, YaRN with mscale_all_dim, tied
    "yarn_q_proj_tied": dict(
        DEEPSEEK_V3,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        rope_parameters=YARN,
        max_position_embeddings=16384,  # factor 4 x original 4096
        tie_word_embeddings=True,
    ),
}


def hf_config(name: str, **changes):
    fields = dict(VARIANTS[name], **changes)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def tiny_deepseek_v3(name: str, seed: int = 0, **changes):
    """A random DeepseekV3ForCausalLM: every parameter and the expert bias drawn, norm weights 1 + noise."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **changes), attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    for pname, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * STD
        p.copy_(1.0 + noise if p.ndim == 1 and pname.endswith("weight") else noise)
    for bname, b in model.named_buffers():
        if bname.endswith("e_score_correction_bias"):  # large enough to change the choice of experts
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model.eval()


def our_model(model_args: dict, state_dict: dict, config_changes=None):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_mfsdp.models.gpt.build import build_gpt_model

    config_kwargs, model_kwargs = hf.transformer_config_kwargs(model_args)
    config_kwargs.update(config_changes or {})
    config_kwargs.update(apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False)
    config = MLATransformerConfig(**config_kwargs, use_cpu_initialization=True)
    model = build_gpt_model(config, **model_kwargs)
    hf.load_into_model(model, state_dict)
    return model.eval()


def batch(vocab_size: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def max_delta(model, hf_model, model_args) -> float:
    tokens = batch()
    return (our_logits(model, tokens, model_args["vocab_size"]) - hf_model(tokens).logits).abs().max().item()


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    hf_model = tiny_deepseek_v3(request.param)
    files = saved_tensors(hf_model, tmp_path_factory.mktemp(request.param))
    state_dict, model_args = hf_to_megatron(files, hf_model.config)
    return request.param, hf_model, files, state_dict, model_args


# ----------------------------------------------------------------------------------------
# Settings and round trips
# ----------------------------------------------------------------------------------------


def test_model_args_are_megatron_dests(converted):
    name, hf_model, files, state_dict, model_args = converted
    assert model_args["multi_latent_attention"] and model_args["qk_layernorm"]
    assert model_args["moe_layer_freq"] == [0, 1, 1] and model_args["ffn_hidden_size"] == 96
    assert model_args["moe_shared_expert_intermediate_size"] == 32 and model_args["moe_ffn_hidden_size"] == 32
    assert model_args["moe_router_score_function"] == "sigmoid" and model_args["moe_router_enable_expert_bias"]
    assert model_args["moe_router_topk_scaling_factor"] == 2.5
    groups = (2, 1) if name == "rope_q_lora_groups" else (None, None)
    assert (model_args["moe_router_num_groups"], model_args["moe_router_group_topk"]) == groups
    assert model_args["rope_type"] == ("rope" if name == "rope_q_lora_groups" else "yarn")
    from megatron_mfsdp.training.arguments import build_parser

    dests = set(vars(build_parser().parse_known_args([])[0]))  # pretrain_gpt.py's, Megatron-LM's names
    ours = {k for k in model_args if k.startswith(("moe_", "rope", "rotary", "mscale"))}
    ours |= set(hf.MLA_CONFIG_FIELDS) | {"num_experts", "qk_layernorm"}
    assert ours <= dests, ours - dests


def test_hf_to_megatron_to_hf_is_bitwise(converted):
    name, hf_model, files, state_dict, model_args = converted
    back, config = megatron_to_hf(state_dict, model_args)
    assert not unequal(back, files)
    carried = NOT_CARRIED | {"num_nextn_predict_layers"}
    theirs = {k: v for k, v in hf_model.config.to_dict().items() if k not in carried}
    ours = {k: v for k, v in config.to_dict().items() if k not in carried}
    assert ours == theirs
    assert type(config) is type(hf_model.config)


def test_megatron_to_hf_to_megatron_is_bitwise(converted):
    name, hf_model, files, state_dict, model_args = converted
    again, args_again = hf_to_megatron(*megatron_to_hf(state_dict, model_args))
    assert args_again == model_args
    assert not unequal(again, state_dict)


def test_in_memory_3d_experts_convert_as_the_files_do(converted):
    name, hf_model, files, state_dict, model_args = converted
    from_memory, args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    assert args == model_args and not unequal(from_memory, state_dict)


def test_our_models_state_dict_converts_back(converted):
    """GPTModel.state_dict() (with the router's expert_bias buffer) converts to the saved files."""
    name, hf_model, files, state_dict, model_args = converted
    back, _ = megatron_to_hf(our_model(model_args, state_dict).state_dict(), model_args)
    assert not unequal(back, files)


# ----------------------------------------------------------------------------------------
# Logits
# ----------------------------------------------------------------------------------------


def test_logits_match_transformers(converted):
    name, hf_model, files, state_dict, model_args = converted
    model = our_model(model_args, state_dict)
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MLP", "MoELayer", "MoELayer"]
    assert type(model.decoder.layers[0].self_attention).__name__ == "MLASelfAttention"
    delta = max_delta(model, hf_model, model_args)
    print(f"\n[hf deepseek_v3] {name}: max |logits ours - transformers| = {delta:.3e} (fp32, batch {BATCH}x{SEQ})")
    assert delta <= TOL


# ----------------------------------------------------------------------------------------
# Negative controls, import
# ----------------------------------------------------------------------------------------


def _per_key(state_dict, suffix, change):
    return {k: change(v) if k.endswith(suffix) else v for k, v in state_dict.items()}


def kv_up_key_value_swapped(state_dict, args):
    """linear_kv_up_proj read as per head [value; key nope] (v_head_dim 12, qk_head_dim 8: swapped in place
    as the first 8 rows and the last 8 rows of each head's 20)."""
    qk, v, heads = args["qk_head_dim"], args["v_head_dim"], args["num_attention_heads"]

    def swap(w):
        w = w.reshape(heads, qk + v, -1).clone()
        w[:, :qk], w[:, -qk:] = w[:, -qk:].clone(), w[:, :qk].clone()
        return w.reshape(heads * (qk + v), -1)

    return _per_key(state_dict, "linear_kv_up_proj.weight", swap)


def rope_deinterleaved(state_dict, args):
    """The rotary rows of the query and of the shared key de-interleaved (a converter that assumes
    megatron rotates halves as transformers' rope_interleave=False does)."""
    qk, pe, heads, rank = args["qk_head_dim"], args["qk_pos_emb_head_dim"], args["num_attention_heads"], None
    order = torch.cat([torch.arange(0, pe, 2), torch.arange(1, pe, 2)])

    def query(w):
        w = w.reshape(heads, qk + pe, -1).clone()
        w[:, qk:] = w[:, qk:][:, order]
        return w.reshape(heads * (qk + pe), -1)

    def key(w):
        w = w.clone()
        rank = w.shape[0] - pe
        w[rank:] = w[rank:][order]
        return w

    del rank
    out = _per_key(state_dict, "linear_q_up_proj.weight", query)
    out = _per_key(out, "linear_q_proj.weight", query)
    return _per_key(out, "linear_kv_down_proj.weight", key)


def expert_bias_dropped(state_dict, args):
    return _per_key(state_dict, "router.expert_bias", torch.zeros_like)


def shared_gate_up_swapped(state_dict, args):
    return _per_key(state_dict, "shared_experts.linear_fc1.weight", lambda w: torch.cat(w.chunk(2)[::-1]))


IMPORT_CONTROLS = {
    "kv_b_proj_key_value_swapped": dict(state=kv_up_key_value_swapped),
    "rope_rows_deinterleaved": dict(state=rope_deinterleaved),
    "e_score_correction_bias_dropped": dict(state=expert_bias_dropped),
    "shared_expert_gate_up_swapped": dict(state=shared_gate_up_swapped),
    "routed_scaling_factor_dropped": dict(config=dict(moe_router_topk_scaling_factor=None)),
    "group_limit_dropped": dict(config=dict(moe_router_num_groups=None, moe_router_group_topk=None)),
}


@pytest.mark.parametrize("control", list(IMPORT_CONTROLS))
def test_import_negative_control_breaks_logits(control):
    change = IMPORT_CONTROLS[control]
    hf_model = tiny_deepseek_v3("rope_q_lora_groups")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    state_dict = change.get("state", lambda s, a: s)(state_dict, model_args)
    delta = max_delta(our_model(model_args, state_dict, change.get("config")), hf_model, model_args)
    print(f"\n[hf deepseek_v3] import negative control {control}: max |logits ours - transformers| = {delta:.3e}")
    assert delta > CONTROL_MIN


def test_yarn_mscale_is_needed():
    """YaRN's softmax scale (mscale_all_dim) dropped on our side moves the logits: the YaRN variant's
    agreement checks the scale, not a no-op."""
    hf_model = tiny_deepseek_v3("yarn_q_proj_tied")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    delta = max_delta(our_model(model_args, state_dict, dict(mscale_all_dim=0.0)), hf_model, model_args)
    print(f"\n[hf deepseek_v3] import negative control mscale_all_dim_dropped: {delta:.3e}")
    assert delta > CONTROL_MIN


# Kimi K2's rope_parameters (its config.json: factor 32, beta_fast 1, beta_slow 1, original 4096), with a shorter
# original length so that the tiny model's 24 positions reach YaRN's blend of interpolated and extrapolated parts.
KIMI_K2_YARN = dict(YARN, factor=32.0, beta_fast=1.0, beta_slow=1.0, original_max_position_embeddings=16)


def test_kimi_k2_yarn_settings_import_through_the_yarn_flags_and_back():
    """beta_fast, beta_slow and the original length become --yarn-beta-fast, --yarn-beta-slow and
    --yarn-original-max-position-embeddings (MLATransformerConfig's fields): the logits equal transformers', the
    export writes them back, and MLATransformerConfig's defaults in their place move the logits (control)."""
    hf_model = tiny_deepseek_v3("yarn_q_proj_tied", rope_parameters=KIMI_K2_YARN, max_position_embeddings=512)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    assert (model_args["yarn_beta_fast"], model_args["yarn_beta_slow"]) == (1.0, 1.0)
    assert model_args["yarn_original_max_position_embeddings"] == 16
    delta = max_delta(our_model(model_args, state_dict), hf_model, model_args)
    defaults = dict(beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096)
    control = max_delta(our_model(model_args, state_dict, defaults), hf_model, model_args)
    print(f"\n[hf deepseek_v3] Kimi K2 YaRN: {delta:.3e}; with megatron's YaRN defaults instead: {control:.3e}")
    assert delta <= TOL and control > CONTROL_MIN
    rope = megatron_to_hf(state_dict, model_args)[1].rope_parameters
    assert {k: rope[k] for k in ("beta_fast", "beta_slow", "original_max_position_embeddings")} == {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 16,
    }


# ----------------------------------------------------------------------------------------
# Negative controls, export
# ----------------------------------------------------------------------------------------


def _layers_with_bias_dropped(src, dst, model_args, to_megatron):
    original(src, dst, model_args, to_megatron)
    for key in [k for k in dst if k.endswith("e_score_correction_bias")]:
        dst[key] = torch.zeros_like(dst[key])


original = hf._deepseek_v3_layers
EXPORT_CONTROLS = {
    "split_gate_up_swapped": ("split_gate_up", lambda fc1: tuple(t.clone() for t in fc1.chunk(2)[::-1])),
    "expert_bias_dropped": ("_deepseek_v3_layers", _layers_with_bias_dropped),
}


@pytest.mark.parametrize("control", list(EXPORT_CONTROLS))
def test_export_negative_control_fails_the_round_trip(control, monkeypatch, tmp_path):
    hf_model = tiny_deepseek_v3("rope_q_lora_groups")
    files = saved_tensors(hf_model, tmp_path)
    state_dict, model_args = hf_to_megatron(files, hf_model.config)
    attribute, wrong = EXPORT_CONTROLS[control]
    monkeypatch.setattr(hf, attribute, wrong)
    bad = unequal(megatron_to_hf(state_dict, model_args)[0], files)
    print(f"\n[hf deepseek_v3] export negative control {control}: {len(bad)} of {len(files)} tensors differ")
    assert bad and all(".mlp." in k for k in bad), bad


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,setting",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
        (dict(rope_interleave=False), "rope_interleave"),
        (dict(n_shared_experts=0), "n_shared_experts"),
        (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "topk_group"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(first_k_dense_replace=3), "first_k_dense_replace"),
        (dict(rope_parameters=dict(YARN, truncate=False)), "truncate"),
        (dict(rope_parameters=dict(YARN, mscale=None)), "mscale"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    ],
)
def test_hf_settings_without_counterpart_are_refused(changes, setting):
    with pytest.raises(ConversionError, match=setting):
        hf_to_megatron({}, hf_config("rope_q_lora_groups", **changes))


def test_mtp_tensors_are_refused():
    hf_model = tiny_deepseek_v3("rope_q_lora_groups")
    tensors = dict(hf_model.state_dict(), **{"model.layers.3.eh_proj.weight": torch.zeros(64, 128)})
    with pytest.raises(ConversionError, match="num_nextn_predict_layers"):
        hf_to_megatron(tensors, hf_model.config)


@pytest.mark.parametrize(
    "changes,setting",
    [
        (dict(moe_shared_expert_intermediate_size=None), "moe_shared_expert_intermediate_size"),
        (dict(moe_shared_expert_intermediate_size=48), "moe_shared_expert_intermediate_size"),
        (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate"),
        (dict(moe_router_score_function="softmax"), "moe_router_score_function"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=2), "moe_router_group_topk"),
        (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
        (dict(mtp_num_layers=1), "mtp_num_layers"),
        (dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=0.7, mscale_all_dim=0.0), "mscale"),
        (dict(moe_layer_freq=[1, 0, 1]), "moe_layer_freq"),
        (dict(layernorm_epsilon=1e-5), "layernorm_epsilon"),
        (dict(qk_layernorm=False), "qk_layernorm"),
    ],
)
def test_megatron_settings_without_counterpart_are_refused(changes, setting):
    hf_model = tiny_deepseek_v3("rope_q_lora_groups")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    with pytest.raises(ConversionError, match=setting):
        megatron_to_hf(state_dict, dict(model_args, **changes))


def test_mla_without_experts_is_refused():
    args = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, max_position_embeddings=64)
    with pytest.raises(ConversionError, match="multi_latent_attention"):
        hf.transformer_config_kwargs(dict(args, multi_latent_attention=True, vocab_size=100))
