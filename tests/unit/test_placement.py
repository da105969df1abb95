"""Planner and placement rules: determinism, balance on a GPT, layout coverage, bad input."""

import pytest
import torch

from megatron_mfsdp.config import MatrixFSDPConfig
from megatron_mfsdp.models.gpt import GPT_ADAPTER, build_gpt_model, gpt_param_rules
from megatron_mfsdp.optim import registry
from megatron_mfsdp.placement import SLICE, WHOLE, ParamSpec, UnitSpec, balance, plan_units
from megatron_mfsdp.placement.bounds import plan_bounds
from megatron_mfsdp.runtime.wrapper import unit_specs
from megatron_mfsdp.testing import init_megatron, optimizer_config, run_workers, tiny_gpt_config

GPT_RULES = registry.rule_set(gpt_param_rules("muon"))


def classify(name, shape, user_rules=()):
    return registry.rule_set(list(user_rules) + gpt_param_rules("muon")).classify(name, shape)


def _gpt_specs_worker(rank, world_size, layers, hidden, ffn, heads, groups, vocab):
    """Unit specs of a megatron GPTModel built on the meta device (no memory)."""
    init_megatron()
    cfg = tiny_gpt_config(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        perform_initialization=False,
    )
    with torch.device("meta"):
        model = build_gpt_model(cfg, vocab_size=vocab, max_sequence_length=2048)
    return unit_specs(GPT_ADAPTER.units(model), MatrixFSDPConfig(), GPT_ADAPTER, cfg)


@pytest.fixture(scope="module")
def gpt_24x2048_specs():
    return run_workers(1, _gpt_specs_worker, 24, 2048, 8192, 16, 16, 50304)[0]


def _check_layout_covers_every_element_once(plan):
    for unit in plan.units:
        covered = torch.zeros(unit.numel, dtype=torch.int32)
        for r in range(plan.world_size):
            for piece in unit.local_pieces(r):
                start = piece.slot.offset + piece.param_offset
                covered[start : start + piece.numel] += 1
                if piece.slot.storage == WHOLE:
                    assert piece.slot.owner == r and piece.numel == piece.slot.numel  # whole, on its owner
        assert torch.all(covered == 1), unit.name
        # Segments: matrix parts are contiguous in rank order, tail split within one element.
        sizes = [unit.tail_bounds[r + 1] - unit.tail_bounds[r] for r in range(plan.world_size)]
        assert max(sizes) - min(sizes) <= 1


def test_default_rules_classify_megatron_gpt_names():
    assert classify("decoder.layers.0.self_attention.linear_qkv.weight", (96, 32)) == "muon"
    assert classify("decoder.layers.3.mlp.linear_fc2.weight", (32, 64)) == "muon"
    assert classify("decoder.layers.0.mlp.linear_fc1.bias", (64,)) == "adamw"
    assert classify("decoder.layers.0.input_layernorm.weight", (32,)) == "adamw"
    assert classify("embedding.word_embeddings.weight", (100, 32)) == "adamw"
    assert classify("output_layer.weight", (100, 32)) == "adamw"
    # A user rule overrides the built-in one.
    assert classify("output_layer.weight", (100, 32), [("output_layer.weight", "muon")]) == "muon"
    assert GPT_RULES.storage("muon") == WHOLE and GPT_RULES.storage("adamw") == SLICE


def test_parameter_that_fits_no_rule_is_named():
    message = r"'decoder.layers.0.router.gate' .*fits no placement rule.*--mfsdp-param-rule"
    with pytest.raises(ValueError, match=message):
        classify("decoder.layers.0.router.gate", (8, 32))


def test_muon_rule_on_a_vector_is_rejected():
    with pytest.raises(ValueError, match="muon needs a 2D matrix") as err:
        classify("decoder.final_layernorm.weight", (32,), [("*final_layernorm*", "muon")])
    assert "--mfsdp-param-rule 'decoder.final_layernorm.weight=adamw'" in str(err.value)  # the name, not '{name}'
    with pytest.raises(ValueError, match="unknown update rule 'sgdm'"):
        classify("decoder.final_layernorm.weight", (32,), [("*final_layernorm*", "sgdm")])


def test_unknown_planner_policy_is_rejected():
    with pytest.raises(ValueError, match="--mfsdp-planner"):
        MatrixFSDPConfig(planner="random")
    with pytest.raises(ValueError, match="--mfsdp-planner"):
        plan_units([], 2, "random")


@pytest.mark.parametrize(
    "field,value,flag",
    [
        ("muon_scale_mode", "frobenius", "--muon-scale-mode"),
        ("muon_coefficient_type", "cubic", "--muon-coefficient-type"),
        ("muon_ns_dtype", "fp8", "--muon-ns-dtype"),
        ("optimizer", "lamb", "--optimizer"),
    ],
)
def test_bad_optimizer_settings_name_their_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        optimizer_config(**{field: value})


def test_plan_is_deterministic_and_digest_sensitive(gpt_24x2048_specs):
    a = plan_units(gpt_24x2048_specs, 8, "greedy")
    b = plan_units(gpt_24x2048_specs, 8, "greedy")
    assert a.digest() == b.digest()
    assert plan_units(gpt_24x2048_specs, 4, "greedy").digest() != a.digest()


@pytest.mark.parametrize("world_size,max_balance", [(8, 1.05), (64, 1.40)])
def test_gpt_24_layers_hidden_2048_balance(gpt_24x2048_specs, world_size, max_balance):
    """At W=64 the 72 matrices of 9 units of NS work (QKV as three 2048^2 blocks, fc1, fc2;
    linear_proj is 3) put two on some rank: 18 against a mean of 11.25, so NS max/mean 1.6 is
    the optimum (the lower bound), and the plan must reach it."""
    plan = plan_units(gpt_24x2048_specs, world_size, "auto")
    elements, costs = plan.per_rank_load()
    bound = plan_bounds(gpt_24x2048_specs, world_size).ns_flops
    print(
        f"\nW={world_size} policy={plan.policy}: bytes max/mean {balance(elements):.3f}, "
        f"NS flops max/mean {balance(costs):.3f} (lower bound {bound:.3f})"
    )
    assert balance(elements) <= max_balance and balance(costs) <= max(max_balance, bound + 1e-9)
    _check_layout_covers_every_element_once(plan)
    # 'auto' is never worse than either policy it chooses from.
    for policy in ("greedy", "global"):
        other = plan_units(gpt_24x2048_specs, world_size, policy)
        assert max(map(balance, plan.per_rank_load())) <= max(map(balance, other.per_rank_load()))


def test_more_ranks_than_matrices_leaves_empty_segments():
    unit = UnitSpec(
        "layer1",
        [
            ParamSpec("a.linear_fc1.weight", (8, 4), "muon", WHOLE, 128),
            ParamSpec("a.linear_fc2.weight", (4, 8), "muon", WHOLE, 128),
            ParamSpec("a.bias", (3,), "adamw", SLICE),
        ],
    )
    plan = plan_units([unit], 5, "greedy")
    layout = plan.units[0]
    owners = {s.owner for s in layout.slots if s.storage == WHOLE}
    assert len(owners) == 2
    empty = [r for r in range(5) if layout.segment_numel(r) == 0]
    # Ranks 0 and 1 take the two matrices, ranks 0-2 one tail element each: 3 and 4 hold nothing.
    assert owners == {0, 1} and empty == [3, 4]
    _check_layout_covers_every_element_once(plan)


def test_world_size_one_owns_everything():
    unit = UnitSpec(
        "u", [ParamSpec("w.linear_proj.weight", (4, 4), "muon", WHOLE, 64), ParamSpec("b.bias", (4,), "adamw", SLICE)]
    )
    plan = plan_units([unit], 1)
    assert plan.units[0].segment_numel(0) == 20
    _check_layout_covers_every_element_once(plan)
