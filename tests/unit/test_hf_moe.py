"""Qwen3MoeForCausalLM <-> megatron-core GPTModel with MoE layers (models/gpt/hf.py), on tiny random
models built from configs (nothing from the hub), fp32, one process:

- HF -> ours -> HF is bitwise against what save_pretrained writes (one Linear per expert), and the
  config comes back equal; ours -> HF -> ours is bitwise; transformers' in-memory 3D experts convert
  as the files do;
- our GPTModel (megatron-core's MoELayer, TopKRouter, SequentialMLP experts; q/k layernorm; dense
  layers where --moe-layer-freq says 0) gives transformers' logits within 1e-5, with and without
  norm_topk_prob, at top-1 and top-2;
- negative controls either way: a wrong mapping on import (experts swapped but not their router rows,
  an expert's gate/up halves swapped, q_norm/k_norm swapped, norm_topk_prob read backwards) moves the
  logits far past that tolerance; a wrong mapping on export (the converter's gate/up split or expert
  numbering patched wrong) fails the round-trip comparison;
- MoE settings either side cannot express are refused by name.

Weights are drawn with std 0.2, norm weights 1 + noise (tests/unit/test_hf.py explains why).
``pytest -s`` prints the measured deltas.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron_mfsdp.models.gpt import hf  # noqa: E402
from megatron_mfsdp.models.gpt.hf import (  # noqa: E402
    ConversionError,
    hf_to_megatron,
    load_hf_checkpoint,
    megatron_to_hf,
    save_hf_checkpoint,
)
from tests.unit.test_hf import STD, megatron_state, our_logits, our_model  # noqa: E402, F401

TOL = 1e-5  # max |logits ours - transformers| in fp32
CONTROL_MIN = 1e-3  # a wrong mapping must move the logits at least 100 x TOL
BATCH, SEQ = 2, 24

QWEN3_MOE = dict(
    model_type="qwen3_moe",
    vocab_size=100,  # padded to 128 on our side
    hidden_size=64,
    intermediate_size=96,  # the dense (mlp_only) layers
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,  # != hidden / heads
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    router_aux_loss_coef=0.01,
    bos_token_id=0,
    eos_token_id=1,
)
VARIANTS = {
    # one dense layer first (mlp_only_layers), then MoE; renormalized top-2 (Qwen3-30B-A3B's choice)
    "dense0_norm_topk_untied": dict(QWEN3_MOE, mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False),
    # every 2nd layer sparse (layers 1 and 3: megatron's integer frequency would say 0 and 2), plain top-2
    "sparse_step2_tied": dict(
        QWEN3_MOE, num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True
    ),
    # top-1 without renormalization (megatron-core's top-1 softmax router needs --moe-router-pre-softmax)
    "top1_all_sparse": dict(QWEN3_MOE, num_experts_per_tok=1, norm_topk_prob=False, num_experts=4),
}
NOT_CARRIED = {"architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"}
NOT_CARRIED |= {"bos_token_id", "eos_token_id", "pad_token_id"}


def hf_config(name: str, **changes):
    fields = dict(VARIANTS[name], **changes)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def tiny_qwen3_moe(name: str, seed: int = 0, **changes):
    """A random Qwen3MoeForCausalLM of a variant: every parameter drawn, norm weights 1 + noise."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **changes), attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    for pname, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * STD
        p.copy_(1.0 + noise if p.ndim == 1 and pname.endswith("weight") else noise)
    return model.eval()


def saved_tensors(model, folder) -> dict:
    """What save_pretrained writes (one Linear per expert, no tied lm_head), read back from ``folder``."""
    from safetensors.torch import load_file

    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


def batch(vocab_size: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def max_delta(model, hf_model, model_args) -> float:
    tokens = batch()
    return (our_logits(model, tokens, model_args["vocab_size"]) - hf_model(tokens).logits).abs().max().item()


def unequal(got: dict, expected: dict) -> list[str]:
    """The round-trip comparison: names missing or extra, and tensors not bitwise equal."""
    names = sorted(set(got) ^ set(expected))
    return names + sorted(k for k in set(got) & set(expected) if not torch.equal(got[k], expected[k]))


def _converted(name: str, folder):
    hf_model = tiny_qwen3_moe(name)
    files = saved_tensors(hf_model, folder)
    state_dict, model_args = hf_to_megatron(files, hf_model.config)
    return name, hf_model, files, state_dict, model_args


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def dense0(tmp_path_factory):
    """The first variant only, for the refusals."""
    return _converted("dense0_norm_topk_untied", tmp_path_factory.mktemp("dense0"))


# ----------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------


def test_model_args_are_megatron_dests(converted):
    """Megatron-LM's dests (megatron/training/arguments.py at core_v0.16.1), the layer pattern in
    --moe-layer-freq's list form, and the router's normalization as --moe-router-pre-softmax."""
    name, hf_model, files, state_dict, model_args = converted
    cfg = hf_model.config
    assert model_args["num_experts"] == cfg.num_experts and model_args["moe_router_topk"] == cfg.num_experts_per_tok
    assert model_args["moe_ffn_hidden_size"] == 32 and model_args["ffn_hidden_size"] == 96
    assert model_args["qk_layernorm"] and model_args["swiglu"] and not model_args["add_bias_linear"]
    assert model_args["moe_router_pre_softmax"] is (not cfg.norm_topk_prob)
    assert model_args["moe_aux_loss_coeff"] == 0.01 and model_args["moe_router_score_function"] == "softmax"
    expected = {
        "dense0_norm_topk_untied": [0, 1, 1],
        "sparse_step2_tied": [0, 1, 0, 1],
        "top1_all_sparse": 1,
    }[name]
    assert model_args["moe_layer_freq"] == expected
    from megatron_mfsdp.training.arguments import build_parser

    dests = set(vars(build_parser().parse_known_args([])[0]))  # pretrain_gpt.py's, Megatron-LM's names
    moe = {k for k in model_args if k.startswith("moe_")} | {"num_experts", "qk_layernorm"}
    assert moe <= dests, moe - dests


def test_layer_pattern_maps_both_ways():
    """HF counts decoder_sparse_step from layer 1, megatron's integer --moe-layer-freq from layer 0: an
    integer frequency of 2 goes to HF as mlp_only_layers, HF's step 2 comes back as a step."""
    args = {"num_layers": 4, "moe_layer_freq": 2, "num_experts": 4}
    assert hf.moe_layer_pattern(args) == [True, False, True, False]
    assert hf._qwen3_moe_sparsity([True, False, True, False]) == {"decoder_sparse_step": 1, "mlp_only_layers": [1, 3]}
    assert hf._qwen3_moe_sparsity([False, True, False, True]) == {"decoder_sparse_step": 2, "mlp_only_layers": []}
    assert hf._qwen3_moe_sparsity([True] * 4) == {"decoder_sparse_step": 1, "mlp_only_layers": []}
    assert hf._qwen3_moe_pattern(hf_config("sparse_step2_tied")) == [False, True, False, True]


# ----------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------


def test_hf_to_megatron_to_hf_is_bitwise(converted):
    name, hf_model, files, state_dict, model_args = converted
    back, config = megatron_to_hf(state_dict, model_args)
    assert not unequal(back, files)
    experts = [k for k in back if ".mlp.experts." in k]
    moe_layers = sum(hf._qwen3_moe_pattern(hf_model.config))
    assert len(experts) == 3 * hf_model.config.num_experts * moe_layers
    theirs = {k: v for k, v in hf_model.config.to_dict().items() if k not in NOT_CARRIED}
    ours = {k: v for k, v in config.to_dict().items() if k not in NOT_CARRIED}
    assert ours == theirs
    assert type(config) is type(hf_model.config)


def test_megatron_to_hf_to_megatron_is_bitwise(converted):
    name, hf_model, files, state_dict, model_args = converted
    again, args_again = hf_to_megatron(*megatron_to_hf(state_dict, model_args))
    assert args_again == model_args
    assert not unequal(again, state_dict)


def test_in_memory_3d_experts_convert_as_the_files_do(converted):
    """transformers 5 holds each layer's experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    name, hf_model, files, state_dict, model_args = converted
    memory = hf_model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in memory)
    from_memory, args = hf_to_megatron(memory, hf_model.config)
    assert args == model_args
    assert not unequal(from_memory, state_dict)


def test_our_models_state_dict_converts_back(converted):
    """GPTModel.state_dict() as the converter reads it (megatron's _extra_state entries; no
    output_layer when tied) converts to the saved files."""
    name, hf_model, files, state_dict, model_args = converted
    back, _ = megatron_to_hf(our_model(model_args, state_dict).state_dict(), model_args)
    assert not unequal(back, files)


@torch.no_grad()
def test_saved_conversion_is_read_by_transformers(converted, tmp_path):
    name, hf_model, files, state_dict, model_args = converted
    save_hf_checkpoint(str(tmp_path), *megatron_to_hf(state_dict, model_args))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is type(hf_model)
    assert not unequal(loaded.state_dict(), hf_model.state_dict())
    assert torch.equal(loaded(batch()).logits, hf_model(batch()).logits)
    again, _ = load_hf_checkpoint(str(tmp_path))
    assert not unequal(again, files)


# ----------------------------------------------------------------------------------------
# Logits
# ----------------------------------------------------------------------------------------


def test_logits_match_transformers(converted):
    name, hf_model, files, state_dict, model_args = converted
    model = our_model(model_args, state_dict)
    layers = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    assert layers == ["MoELayer" if s else "MLP" for s in hf._qwen3_moe_pattern(hf_model.config)]
    experts = [layer.mlp.experts for layer in model.decoder.layers if type(layer.mlp).__name__ == "MoELayer"]
    assert all(type(e).__name__ == "SequentialMLP" for e in experts)
    delta = max_delta(model, hf_model, model_args)
    print(f"\n[hf moe] {name}: max |logits ours - transformers| = {delta:.3e} (fp32, batch {BATCH}x{SEQ})")
    assert delta <= TOL


# ----------------------------------------------------------------------------------------
# Negative controls, import: each wrong mapping must move the logits far past TOL
# ----------------------------------------------------------------------------------------


def swapped_experts(state_dict, args):
    """Experts 0 and 1 of every MoE layer exchanged, their router rows left: a wrong expert index."""
    out = dict(state_dict)
    for key, value in state_dict.items():
        for a, b in ((".local_experts.0.", ".local_experts.1."), (".local_experts.1.", ".local_experts.0.")):
            if a in key:
                out[key.replace(a, b)] = value
    return out


def swapped_expert_gate_up(state_dict, args):
    """Each expert's linear_fc1 as [up; gate]."""
    out = dict(state_dict)
    for key, value in state_dict.items():
        if ".local_experts." in key and "linear_fc1" in key:
            gate, up = value.chunk(2)
            out[key] = torch.cat([up, gate])
    return out


def swapped_qk_norm(state_dict, args):
    out = dict(state_dict)
    for key, value in state_dict.items():
        if "q_layernorm" in key:
            out[key], out[key.replace("q_layernorm", "k_layernorm")] = (
                out[key.replace("q_layernorm", "k_layernorm")],
                value,
            )
    return out


IMPORT_CONTROLS = {
    "swapped_experts": ("dense0_norm_topk_untied", dict(state=swapped_experts)),
    "swapped_expert_gate_up": ("dense0_norm_topk_untied", dict(state=swapped_expert_gate_up)),
    "swapped_q_k_norm": ("dense0_norm_topk_untied", dict(state=swapped_qk_norm)),
    # norm_topk_prob read backwards: softmax over all experts, then top-k, left unnormalized
    "norm_topk_prob_as_pre_softmax": ("dense0_norm_topk_untied", dict(config=dict(moe_router_pre_softmax=True))),
    "no_norm_as_renormalized_topk": ("sparse_step2_tied", dict(config=dict(moe_router_pre_softmax=False))),
}


@pytest.mark.parametrize("control", list(IMPORT_CONTROLS))
def test_import_negative_control_breaks_logits(control, tmp_path):
    name, change = IMPORT_CONTROLS[control]
    hf_model = tiny_qwen3_moe(name)
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    state_dict = change.get("state", lambda s, a: s)(state_dict, model_args)
    model = our_model(model_args, state_dict, change.get("config"))
    delta = max_delta(model, hf_model, model_args)
    print(f"\n[hf moe] import negative control {control}: max |logits ours - transformers| = {delta:.3e}")
    assert delta > CONTROL_MIN


def test_consistent_expert_relabelling_is_invisible():
    """Experts and their router rows permuted together are the same model: the logits comparison
    checks the mapping, not the numbering (so swapped_experts fails for the right reason)."""
    hf_model = tiny_qwen3_moe("dense0_norm_topk_untied")
    state_dict, model_args = hf_to_megatron(hf_model.state_dict(), hf_model.config)
    relabelled = swapped_experts(state_dict, model_args)
    for key in [k for k in state_dict if k.endswith("mlp.router.weight")]:
        relabelled[key] = state_dict[key][[1, 0, *range(2, model_args["num_experts"])]]
    assert max_delta(our_model(model_args, relabelled), hf_model, model_args) <= TOL


# ----------------------------------------------------------------------------------------
# Negative controls, export: a wrong mapping in the converter fails the round trip
# ----------------------------------------------------------------------------------------


def _gate_up_swapped(fc1):
    gate, up = fc1.chunk(2)
    return up.clone(), gate.clone()


def _experts_reversed(model_args, i):
    pairs = [(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.", "") for e in range(model_args["num_experts"])]
    theirs = [f"model.layers.{i}.mlp.experts.{e}." for e in reversed(range(model_args["num_experts"]))]
    return [(ours, t) for (ours, _), t in zip(pairs, theirs)]


EXPORT_CONTROLS = {
    "split_gate_up_swapped": ("split_gate_up", _gate_up_swapped),
    "expert_numbering_reversed": ("_expert_prefixes", _experts_reversed),
}


@pytest.mark.parametrize("control", list(EXPORT_CONTROLS))
def test_export_negative_control_fails_the_round_trip(control, monkeypatch, tmp_path):
    """The converter's own export, with one of its mapping functions patched wrong: the comparison of
    test_hf_to_megatron_to_hf_is_bitwise names the expert tensors (and only those)."""
    hf_model = tiny_qwen3_moe("dense0_norm_topk_untied")
    files = saved_tensors(hf_model, tmp_path)
    state_dict, model_args = hf_to_megatron(files, hf_model.config)
    assert not unequal(megatron_to_hf(state_dict, model_args)[0], files)
    attribute, wrong = EXPORT_CONTROLS[control]
    monkeypatch.setattr(hf, attribute, wrong)
    back, _ = megatron_to_hf(state_dict, model_args)
    bad = unequal(back, files)
    print(f"\n[hf moe] export negative control {control}: {len(bad)} of {len(files)} tensors differ")
    assert bad and all(".mlp." in k for k in bad), bad
    if control == "split_gate_up_swapped":  # the dense layer's MLP shares the split
        assert {k.rsplit(".", 2)[-2] for k in bad} == {"gate_proj", "up_proj"}
    else:
        assert all(".mlp.experts." in k for k in bad)


# ----------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes,setting",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
        (dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob"),
        (dict(mlp_only_layers=[0, 1, 2]), "mlp_only_layers"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    ],
)
def test_hf_settings_without_counterpart_are_refused(changes, setting):
    with pytest.raises(ConversionError, match=setting):
        hf_to_megatron({}, hf_config("dense0_norm_topk_untied", **changes))


@pytest.mark.parametrize(
    "changes,setting",
    [
        (dict(moe_shared_expert_intermediate_size=64), "moe_shared_expert_intermediate_size"),
        (dict(moe_router_score_function="sigmoid"), "moe_router_score_function"),
        (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups"),
        (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias"),
        (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
        (dict(moe_apply_probs_on_input=True), "moe_apply_probs_on_input"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type"),
        (dict(moe_aux_loss_coeff=[0.01, 0.001]), "moe_aux_loss_coeff"),
        (dict(qk_layernorm=False), "qk_layernorm"),
        (dict(add_bias_linear=True), "add_bias_linear"),
        (dict(moe_layer_freq=[1, 1]), "moe_layer_freq"),
    ],
)
def test_megatron_moe_settings_without_counterpart_are_refused(dense0, changes, setting):
    name, hf_model, files, state_dict, model_args = dense0
    with pytest.raises(ConversionError, match=setting):
        megatron_to_hf(state_dict, dict(model_args, **changes))


def test_missing_and_leftover_expert_tensors_are_refused(dense0):
    name, hf_model, files, state_dict, model_args = dense0
    gone = "model.layers.1.mlp.experts.7.down_proj.weight"
    with pytest.raises(ConversionError, match="experts.7.down_proj"):
        hf_to_megatron({k: v for k, v in files.items() if k != gone}, hf_model.config)
    extra = dict(files, **{"model.layers.1.mlp.experts.8.down_proj.weight": files[gone]})
    with pytest.raises(ConversionError, match="no counterpart.*experts.8.down_proj"):
        hf_to_megatron(extra, hf_model.config)
