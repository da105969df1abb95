"""Hugging Face <-> megatron-core GPTModel conversion (models/gpt/hf.py), on tiny random models
built from configs (nothing from the hub), in fp32 on one process:

- HF -> ours -> HF is bitwise, and so is ours -> HF -> ours;
- our GPTModel loaded with the converted weights gives transformers' logits within 1e-5 and
  the same greedy tokens as transformers' ``generate``;
- negative controls (a naive Q/K/V split, swapped SwiGLU halves, erf GELU for GPT-2's
  gelu_new, interleaved RoPE, ...) move the logits far past that tolerance, so the logits
  test can fail;
- settings without a counterpart are refused by name; safetensors files round trip and are
  read by transformers itself.

Weights are drawn with std 0.2 and norm weights and biases are random too: with megatron's
0.02 a swapped mapping can hide under the tolerance, and unit norm weights hide swapped norms.
Run with ``pytest -s`` to see the measured deltas.
"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.compat.cpu import cuda_on_cpu  # noqa: E402
from megatron_mfsdp.models.gpt import build_gpt_model  # noqa: E402
from megatron_mfsdp.models.gpt.hf import (  # noqa: E402
    ConversionError,
    hf_to_megatron,
    load_hf_checkpoint,
    load_into_model,
    megatron_to_hf,
    save_hf_checkpoint,
    split_qkv,
    transformer_config_kwargs,
)
from megatron_mfsdp.testing import init_megatron  # noqa: E402

TOL = 1e-5  # max |logits ours - transformers| in fp32
CONTROL_MIN = 1e-3  # a wrong mapping must move the logits at least 100 x TOL
STD = 0.2
BATCH, SEQ = 2, 24

LLAMA = dict(
    model_type="llama",
    vocab_size=100,  # padded to 128 on our side
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,  # HF's default, not megatron's 1e-5: must be carried
    rope_theta=50000.0,  # not megatron's default 10000: must be carried
    bos_token_id=0,
    eos_token_id=1,
)
GPT2 = dict(
    model_type="gpt2", vocab_size=100, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1
)
VARIANTS = {
    "llama_gqa_tied": dict(LLAMA, tie_word_embeddings=True),
    # 4 query heads per group, head_dim 12 != hidden / heads
    "llama_gqa_untied": dict(LLAMA, num_attention_heads=8, head_dim=12, tie_word_embeddings=False),
    "llama_bias": dict(LLAMA, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "llama3_rope": dict(
        LLAMA,
        rope_theta=500000.0,
        max_position_embeddings=16384,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    "gpt2_gelu_new": dict(GPT2, activation_function="gelu_new"),
    "gpt2_gelu": dict(GPT2, activation_function="gelu"),
}
# Fields no megatron dest carries (tokenizer ids, bookkeeping): left out of the config comparison.
NOT_CARRIED = {"architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"}
NOT_CARRIED |= {"bos_token_id", "eos_token_id", "pad_token_id"}


@pytest.fixture(scope="module", autouse=True)
def megatron_state(tmp_path_factory):
    """megatron-core's GPTModel reads parallel_state: one gloo rank, in this process."""
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


def hf_config(name: str, **changes):
    fields = dict(VARIANTS[name], **changes)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def tiny_hf_model(name: str, seed: int = 0):
    """A random transformers model of a variant: every parameter drawn, norm weights 1 + noise."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    for pname, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * STD
        p.copy_(1.0 + noise if p.ndim == 1 and pname.endswith("weight") else noise)
    return model.eval()


def saved_tensors(model) -> dict:
    """What save_pretrained writes: the state dict without a tied lm_head."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def our_model(model_args: dict, state_dict: dict, config_changes=None, model_changes=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config_kwargs, model_kwargs = transformer_config_kwargs(model_args)
    config_kwargs.update(config_changes or {})
    model_kwargs.update(model_changes or {})
    config = TransformerConfig(**config_kwargs, use_cpu_initialization=True)
    model = build_gpt_model(config, **model_kwargs)
    load_into_model(model, state_dict)
    return model.eval()


def batch() -> torch.Tensor:
    return torch.randint(
        0, VARIANTS["llama_gqa_tied"]["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(7)
    )


@torch.no_grad()
def our_logits(model, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with cuda_on_cpu():  # megatron-core's RoPE moves its frequencies to torch.cuda.current_device()
        logits = model(tokens, positions, None)
    return logits[..., :vocab_size]  # padded vocabulary rows are not tokens


@torch.no_grad()
def max_delta(model, hf_model, model_args) -> float:
    tokens = batch()
    return (our_logits(model, tokens, model_args["vocab_size"]) - hf_model(tokens).logits).abs().max().item()


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request):
    hf_model = tiny_hf_model(request.param)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    return request.param, hf_model, state_dict, model_args


# ----------------------------------------------------------------------------------------
# Round trips and logits
# ----------------------------------------------------------------------------------------


def test_hf_to_megatron_to_hf_is_bitwise(converted):
    name, hf_model, state_dict, model_args = converted
    back, config = megatron_to_hf(state_dict, model_args)
    expected = saved_tensors(hf_model)
    assert sorted(back) == sorted(expected)
    unequal = [k for k in expected if not torch.equal(back[k], expected[k])]
    assert not unequal, unequal
    theirs = {k: v for k, v in hf_model.config.to_dict().items() if k not in NOT_CARRIED}
    ours = {k: v for k, v in config.to_dict().items() if k not in NOT_CARRIED}
    assert ours == theirs
    assert type(config) is type(hf_model.config)


def test_megatron_to_hf_to_megatron_is_bitwise(converted):
    name, hf_model, state_dict, model_args = converted
    again, args_again = hf_to_megatron(*megatron_to_hf(state_dict, model_args))
    assert args_again == model_args
    assert sorted(again) == sorted(state_dict)
    assert all(torch.equal(again[k], state_dict[k]) for k in state_dict)


def test_our_models_state_dict_converts_back(converted):
    """What the converter reads in practice: GPTModel.state_dict(), with megatron's _extra_state
    entries and, when tied, no output_layer."""
    name, hf_model, state_dict, model_args = converted
    back, _ = megatron_to_hf(our_model(model_args, state_dict).state_dict(), model_args)
    expected = saved_tensors(hf_model)
    assert sorted(back) == sorted(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_model_args_use_megatron_dests(converted):
    """Every key is an argument dest of Megatron-LM (megatron/training/arguments.py at core_v0.16.1)."""
    name, hf_model, state_dict, model_args = converted
    dests = {
        *("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention"),
        *("num_query_groups", "kv_channels", "max_position_embeddings", "seq_length", "position_embedding_type"),
        *("rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling", "rope_scaling_factor"),
        *("normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma", "qk_layernorm", "swiglu"),
        *("openai_gelu", "squared_relu", "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights"),
        *("apply_residual_connection_post_layernorm", "vocab_size", "padded_vocab_size"),
        *("make_vocab_size_divisible_by", "init_method_std", "hidden_dropout", "attention_dropout"),
    }
    assert set(model_args) <= dests, set(model_args) - dests
    assert model_args["padded_vocab_size"] == 128 and model_args["vocab_size"] == 100
    assert state_dict["embedding.word_embeddings.weight"].shape[0] == 128
    assert not state_dict["embedding.word_embeddings.weight"][100:].any()  # padding rows are zeros


def test_logits_match_transformers(converted):
    name, hf_model, state_dict, model_args = converted
    delta = max_delta(our_model(model_args, state_dict), hf_model, model_args)
    print(f"\n[hf] {name}: max |logits ours - transformers| = {delta:.3e} (fp32, batch {BATCH}x{SEQ})")
    assert delta <= TOL


def test_llama3_rope_frequencies_match_transformers():
    """megatron's llama3 scaling has fixed bands; its inverse frequencies equal transformers'."""
    hf_model = tiny_hf_model("llama3_rope")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    ours = our_model(model_args, state_dict).rotary_pos_emb.inv_freq
    theirs = hf_model.model.rotary_emb.inv_freq
    default = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert not torch.allclose(theirs, default)  # the scaling changes some frequencies here
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(converted):
    """Argmax decoding by full re-forward on our side equals transformers' generate (KV cache)."""
    name, hf_model, state_dict, model_args = converted
    model, steps = our_model(model_args, state_dict), 8
    prompt = batch()[:, :6]
    hf_model.generation_config.eos_token_id = None  # decode all steps, as ours does (an argmax may be eos)
    theirs = hf_model.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    tokens = prompt
    for _ in range(steps):
        next_token = our_logits(model, tokens, model_args["vocab_size"])[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    assert torch.equal(tokens, theirs), (tokens, theirs)


# ----------------------------------------------------------------------------------------
# Negative controls: each wrong conversion must move the logits far past TOL
# ----------------------------------------------------------------------------------------


def naive_qkv(state_dict, args):
    """What a converter writes that stacks [Q; K; V] instead of grouping them."""
    out = dict(state_dict)
    for key, value in state_dict.items():
        if "linear_qkv" in key:
            heads, groups, dim = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"]
            out[key] = torch.cat(split_qkv(value, heads, groups, dim))
    return out


def swapped_gate_up(state_dict, args):
    out = dict(state_dict)
    for key, value in state_dict.items():
        if "linear_fc1" in key:
            gate, up = value.chunk(2)
            out[key] = torch.cat([up, gate])
    return out


def untransposed_proj(state_dict, args):
    """GPT-2's square c_proj Conv1D taken as it is stored ([in, out]), without transposing."""
    return {k: v.t().contiguous() if k.endswith("linear_proj.weight") else v for k, v in state_dict.items()}


CONTROLS = {
    "llama_naive_qkv_split": ("llama_gqa_untied", dict(state=naive_qkv)),
    "llama_swapped_gate_up": ("llama_gqa_untied", dict(state=swapped_gate_up)),
    "llama_interleaved_rope": ("llama_gqa_untied", dict(config=dict(rotary_interleaved=True))),
    "llama_default_rope_theta": ("llama_gqa_untied", dict(model=dict(rotary_base=10000))),
    "llama_default_norm_eps": ("llama_gqa_untied", dict(config=dict(layernorm_epsilon=1e-5))),
    "llama3_rope_scaling_dropped": ("llama3_rope", dict(model=dict(rope_scaling=False))),
    "gpt2_erf_gelu_for_gelu_new": ("gpt2_gelu_new", dict(config=dict(activation_func=F.gelu))),
    "gpt2_naive_qkv_split": ("gpt2_gelu_new", dict(state=naive_qkv)),
    "gpt2_untransposed_c_proj": ("gpt2_gelu_new", dict(state=untransposed_proj)),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_negative_control_breaks_logits(control):
    name, change = CONTROLS[control]
    hf_model = tiny_hf_model(name)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    state_dict = change.get("state", lambda s, a: s)(state_dict, model_args)
    model = our_model(model_args, state_dict, change.get("config"), change.get("model"))
    delta = max_delta(model, hf_model, model_args)
    print(f"\n[hf] negative control {control}: max |logits ours - transformers| = {delta:.3e}")
    assert delta > CONTROL_MIN


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,changes,setting",
    [
        ("llama_gqa_tied", dict(hidden_act="gelu"), "hidden_act"),
        ("llama_gqa_tied", dict(attention_bias=True, mlp_bias=False), "attention_bias"),
        ("llama_gqa_tied", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_type"),
        ("llama_gqa_tied", dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_type"),
        (
            "llama3_rope",
            dict(rope_scaling=dict(VARIANTS["llama3_rope"]["rope_scaling"], low_freq_factor=2.0)),
            "low_freq_factor",
        ),
        ("gpt2_gelu_new", dict(tie_word_embeddings=False), "tie_word_embeddings"),
        ("gpt2_gelu_new", dict(activation_function="relu"), "activation_function"),
        ("gpt2_gelu_new", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        ("gpt2_gelu_new", dict(scale_attn_weights=False), "scale_attn_weights"),
        ("gpt2_gelu_new", dict(add_cross_attention=True), "add_cross_attention"),
    ],
)
def test_hf_settings_without_counterpart_are_refused(name, changes, setting):
    with pytest.raises(ConversionError, match=setting):
        hf_to_megatron({}, hf_config(name, **changes))


def test_other_architectures_are_refused():
    with pytest.raises(ConversionError, match="model_type"):
        hf_to_megatron({}, transformers.MistralConfig())


@pytest.mark.parametrize(
    "name,changes,setting",
    [
        ("llama_gqa_tied", dict(qk_layernorm=True), "qk_layernorm"),
        ("llama_gqa_tied", dict(rotary_interleaved=True), "rotary_interleaved"),
        ("llama_gqa_tied", dict(rotary_percent=0.5), "rotary_percent"),
        ("llama_gqa_tied", dict(layernorm_zero_centered_gamma=True), "layernorm_zero_centered_gamma"),
        ("llama_gqa_tied", dict(normalization="LayerNorm"), "normalization"),
        ("llama_gqa_tied", dict(add_qkv_bias=True), "add_qkv_bias"),
        ("llama_gqa_tied", dict(vocab_size=None), "vocab_size"),
        ("gpt2_gelu_new", dict(untie_embeddings_and_output_weights=True), "untie_embeddings_and_output_weights"),
        ("gpt2_gelu_new", dict(add_bias_linear=False), "add_bias_linear"),
        ("gpt2_gelu_new", dict(position_embedding_type="rope"), "position_embedding_type"),
    ],
)
def test_megatron_settings_without_counterpart_are_refused(name, changes, setting):
    hf_model = tiny_hf_model(name)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    with pytest.raises(ConversionError, match=setting):
        megatron_to_hf(state_dict, dict(model_args, **changes))


def test_config_json_dict_original_gpt2_names_and_buffers_are_accepted():
    """The original GPT-2 files name GPT2Model's tensors without "transformer." and keep the
    causal-mask buffers; older Llama files keep rotary inv_freq. Neither changes the result."""
    for name, buffers in (
        ("gpt2_gelu_new", {"h.0.attn.bias": torch.ones(1, 1, 64, 64), "h.1.attn.masked_bias": torch.tensor(-1e4)}),
        ("llama_gqa_tied", {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
    ):
        hf_model = tiny_hf_model(name)
        expected, expected_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
        state = {k.removeprefix("transformer."): v for k, v in hf_model.state_dict().items()}
        state_dict, model_args = hf_to_megatron(dict(state, **buffers), hf_model.config.to_dict())
        assert model_args == expected_args
        assert sorted(state_dict) == sorted(expected)
        assert all(torch.equal(state_dict[k], expected[k]) for k in expected)


def test_bf16_round_trip_keeps_dtype():
    hf_model = tiny_hf_model("llama_gqa_untied").to(torch.bfloat16)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    assert all(v.dtype == torch.bfloat16 for v in state_dict.values())
    back, config = megatron_to_hf(state_dict, model_args)
    assert config.dtype == torch.bfloat16
    assert all(torch.equal(back[k], v) for k, v in saved_tensors(hf_model).items())


def test_load_into_model_refuses_a_partial_state_dict():
    hf_model = tiny_hf_model("llama_gqa_tied")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    model = our_model(model_args, state_dict)
    with pytest.raises(ConversionError, match="decoder.final_layernorm.weight"):
        load_into_model(model, {k: v for k, v in state_dict.items() if k != "decoder.final_layernorm.weight"})


def test_missing_and_leftover_tensors_are_refused():
    hf_model = tiny_hf_model("llama_gqa_untied")
    state = hf_model.state_dict()
    with pytest.raises(ConversionError, match="lm_head.weight"):
        hf_to_megatron({k: v for k, v in state.items() if k != "lm_head.weight"}, hf_model.config)
    with pytest.raises(ConversionError, match="no counterpart.*q_norm"):
        hf_to_megatron(dict(state, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(12)}), hf_model.config)


def test_embedding_rows_must_match_vocab_size():
    hf_model = tiny_hf_model("llama_gqa_tied")
    with pytest.raises(ConversionError, match="vocab_size"):
        hf_to_megatron(hf_model.state_dict(), hf_config("llama_gqa_tied", vocab_size=120))


def test_tied_lm_head_must_equal_the_embedding():
    hf_model = tiny_hf_model("llama_gqa_tied")
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ConversionError, match="tied"):
        hf_to_megatron(state, hf_model.config)


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama_gqa_untied", "gpt2_gelu_new"])
def test_load_reads_what_transformers_saves_sharded(name, tmp_path):
    hf_model = tiny_hf_model(name)
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    state_dict, config = load_hf_checkpoint(str(tmp_path))
    expected = saved_tensors(hf_model)
    assert sorted(state_dict) == sorted(expected)
    assert all(torch.equal(state_dict[k], expected[k]) for k in expected)
    saved = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "dtype")}
    assert saved == {k: v for k, v in hf_model.config.to_dict().items() if k not in ("_name_or_path", "dtype")}


@pytest.mark.parametrize("name", ["llama_gqa_tied", "llama_bias", "gpt2_gelu_new"])
@torch.no_grad()
def test_saved_conversion_is_read_by_transformers(name, tmp_path):
    hf_model = tiny_hf_model(name)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    save_hf_checkpoint(str(tmp_path), *megatron_to_hf(state_dict, model_args))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is type(hf_model)
    expected = hf_model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    tokens = batch()
    assert torch.equal(loaded(tokens).logits, hf_model(tokens).logits)
    again, _ = load_hf_checkpoint(str(tmp_path))
    assert sorted(again) == sorted(saved_tensors(hf_model))
    assert all(torch.equal(v, expected[k]) for k, v in again.items())
