"""The owner-collective cost model and the per-unit choice kept with the plan (issue 30): formulas
against hand-computed values, the choice flipping where it should, ties to ``parts``, determinism,
the exact chain kept in rank order, the agreement check catching a rank that chose differently, and a
checkpoint's layout digest untouched by the choice."""

import pytest

from megatron_mfsdp.placement import verify
from megatron_mfsdp.placement.classes import ELEMENTWISE, MATRIX, SLICE, WHOLE
from megatron_mfsdp.placement.collective_cost import (
    CHAIN_CHUNK_BYTES,
    NCCL_A100,
    PADDED,
    PARTS,
    TWO_LEVEL,
    CostConstants,
    Level,
    Topology,
    UnitShape,
    algorithm_time,
    algorithm_times,
    fastest,
)
from megatron_mfsdp.placement.collectives import FULL_TABLE_MAX_UNITS, choose_collectives, collective_choices
from megatron_mfsdp.placement.layout import ParamSpec, UnitSpec, layout_units
from tests.launch import TINY, parse_error
from tests.launch import parse as parse_flags

# Round numbers, so the hand computation below is exact: call 1 s, base 2 s, NVLink hop 0.5 s at
# 100 B/s, network hop 3 s at 10 B/s, intra hops of a ring spanning nodes count 2x.
TOY = CostConstants(1.0, 2.0, Level(0.5, 100.0), Level(3.0, 10.0), 2.0)


def _plan(units: list[list[tuple[str, tuple, int]]], world: int, element_size: int = 2):
    """A plan of units given as (name, shape, owner) rows: owner -1 puts a vector in the tail."""
    specs, owners = [], {}
    for i, rows in enumerate(units):
        params = []
        for name, shape, owner in rows:
            whole = owner >= 0
            params.append(ParamSpec(f"u{i}.{name}", shape, MATRIX if whole else ELEMENTWISE, WHOLE if whole else SLICE))
            if whole:
                owners[f"u{i}.{name}"] = owner
        specs.append(UnitSpec(f"unit{i}", params))
    plan = layout_units(specs, world, owners, "test")
    plan.element_size = element_size
    return plan


def _gpt_layer(hidden: int, owners: tuple[int, int, int, int]) -> list[tuple[str, tuple, int]]:
    """A GPT layer's four matrices on the given owners and its vectors in the tail."""
    ffn = 4 * hidden
    shapes = (("qkv", (3 * hidden, hidden)), ("proj", (hidden, hidden)), ("fc1", (ffn, hidden)), ("fc2", (hidden, ffn)))
    return [(n, s, o) for (n, s), o in zip(shapes, owners)] + [("ln", (hidden,), -1), ("fc1_b", (ffn,), -1)]


def test_formulas_against_hand_computed_values_for_one_unit():
    """W = 4, 2 ranks per node; owner parts of 1000 and 3000 elements on ranks 0 and 2, a tail of 10
    (slices 3, 3, 2, 2); 2 bytes per element."""
    plan = _plan([[("a", (10, 100), 0), ("b", (30, 100), 2), ("n", (10,), -1)]], 4)
    u, t = UnitShape.of(plan.units[0]), Topology(4, 2)
    assert (u.parts, u.tail_slice, u.max_segment, u.numel, u.owners) == ((1000, 3000), 3, 3002, 4010, (0, 2))
    tail = (1 + 2 + 2 * 1.0 + 3) + 3 * 3 * 2 / 10  # 2 intra steps at 0.5 x 2, 1 network step; 18 B at 10 B/s
    parts = (1 + 2 + 4 * 3 + 2000 / 10) + (1 + 2 + 4 * 3 + 6000 / 10) + tail  # W network hops per broadcast
    # both owners at local index 0: one rail carries both parts (2 network hops each), then each node
    # (2 NVLink hops each); the tail's 6-byte slices over the rail (1 step), then 12-byte node blocks
    rail = (1 + 2 + 2 * 3 + 2000 / 10) + (1 + 2 + 2 * 3 + 6000 / 10) + (1 + 2 + 3 + 6 / 10)
    node = (1 + 2 + 2 * 0.5 + 2000 / 100) + (1 + 2 + 2 * 0.5 + 6000 / 100) + (1 + 2 + 0.5 + 12 / 100)
    two_level = rail + node
    padded = (1 + 2 + 2 * 1.0 + 3) + 3 * 3002 * 2 / 10  # one all-gather of 4 segments of the largest, 3002
    assert algorithm_times(u, t, 2, TOY) == pytest.approx((parts, two_level, padded), rel=1e-12)
    assert (parts, two_level, padded) == pytest.approx((839.8, 916.22, 1809.2), rel=1e-12)
    assert fastest(algorithm_times(u, t, 2, TOY)) == PARTS
    assert algorithm_time(PADDED, u, Topology(1, 1), 2, TOY) == 0.0  # one rank: nothing moves
    # the second owner at local index 1 instead: the two rails run at once, the network stage is the busier
    apart = UnitShape.of(_plan([[("a", (10, 100), 0), ("b", (30, 100), 3), ("n", (10,), -1)]], 4).units[0])
    rails = max(1 + 2 + 2 * 3 + 2000 / 10, 1 + 2 + 2 * 3 + 6000 / 10) + (1 + 2 + 3 + 6 / 10)
    assert algorithm_time(TWO_LEVEL, apart, t, 2, TOY) == pytest.approx(rails + node, rel=1e-12)
    assert fastest(algorithm_times(apart, t, 2, TOY)) == TWO_LEVEL


def test_choice_flips_padded_for_a_small_unit_at_small_w_and_two_level_for_a_large_one_at_large_w():
    small = _plan([_gpt_layer(64, (0, 1, 2, 3))], 8)
    choice = choose_collectives(small, 8, "nccl").units[0]
    assert (choice.gather, choice.reduce) == (PADDED, PADDED), choice
    # four owners at four local indices: from 2 nodes on, their rails cross the network at once
    for world, per_node, expected in ((8, 8, PARTS), (64, 8, TWO_LEVEL), (1024, 8, TWO_LEVEL), (1024, 1, PARTS)):
        large = _plan([_gpt_layer(4096, (0, 1, 2, 3))], world)
        choice = choose_collectives(large, per_node, "nccl").units[0]
        assert (choice.gather, choice.reduce) == (expected, expected), (world, per_node, choice)


@pytest.mark.parametrize("hidden,world,per_node", [(64, 8, 8), (256, 64, 8), (1024, 256, 8), (4096, 1024, 8)])
def test_padded_only_where_the_model_says_it_is_faster(hidden, world, per_node):
    plan = _plan([_gpt_layer(hidden, (0, 1, 2, 3)), _gpt_layer(hidden, (4, 4, 5, 6))], world)
    for unit in choose_collectives(plan, per_node, "nccl").units:
        for chosen, times in ((unit.gather, unit.gather_times), (unit.reduce, unit.reduce_times)):
            assert times[(PARTS, TWO_LEVEL, PADDED).index(chosen)] == min(times)
            if chosen == PADDED:  # by more than the margin, against both
                assert times[2] < 0.9 * times[0] and times[2] < 0.9 * times[1]


def test_ties_go_to_parts():
    assert fastest((1.0, 1.0, 1.0)) == PARTS
    assert fastest((1.0, 0.95, 2.0)) == PARTS  # within CHOICE_MARGIN: parts stays
    assert fastest((1.0, 0.85, 0.85)) == TWO_LEVEL  # past it; the tie between the others goes to the earlier
    one_node = _plan([_gpt_layer(4096, (0, 1, 2, 3))], 8)  # two_level is the flat ring here: equal times
    unit = choose_collectives(one_node, 8, "nccl").units[0]
    assert unit.gather_times[0] == unit.gather_times[1] and unit.gather == PARTS


def test_choice_is_deterministic_and_the_same_from_an_equal_plan():
    units = [_gpt_layer(256, (0, 1, 2, 3)), _gpt_layer(2048, (1, 2, 3, 0)), _gpt_layer(64, (5, 5, 6, 7))]
    first = choose_collectives(_plan(units, 64), 8, "nccl")
    again = choose_collectives(_plan(units, 64), 8, "nccl")
    assert first == again and first.digest() == again.digest()
    assert collective_choices(_plan(units, 64), 64, 8, "nccl") == first.choices()
    with pytest.raises(ValueError, match="laid out over 64 ranks, not 32"):
        collective_choices(_plan(units, 64), 32, 8, "nccl")


def test_rank_order_keeps_the_exact_chain_unless_forced():
    plan = _plan([_gpt_layer(64, (0, 1, 2, 3))], 8)
    auto = choose_collectives(plan, 8, "gloo", "auto", "rank").units[0]
    ring = choose_collectives(plan, 8, "gloo", "auto", "ring").units[0]
    assert ring.reduce == PADDED  # by cost alone the small unit's reduction would be padded ...
    assert (auto.reduce, auto.reduce_label) == (PARTS, "chain") and auto.chain_s > 0  # ... but it stays exact
    forced = choose_collectives(plan, 8, "gloo", "two-level", "rank").units[0]
    assert (forced.gather, forced.reduce, forced.reduce_label) == (TWO_LEVEL, TWO_LEVEL, TWO_LEVEL)
    with pytest.raises(ValueError, match="--mfsdp-collectives"):
        choose_collectives(plan, 8, "gloo", "two_level")
    with pytest.raises(ValueError, match="pass it resolved"):
        choose_collectives(plan, 8, "gloo", "auto", "auto")


def test_plan_table_prints_each_choice_with_its_predicted_time():
    plan = _plan([_gpt_layer(64, (0, 1, 2, 3)), _gpt_layer(4096, (4, 5, 6, 7))], 32)
    plan.collectives = choose_collectives(plan, 8, "nccl")
    report = plan.report()
    assert "owner collectives (auto; W 32, 8 ranks per node, nccl, reduce order ring)" in report
    assert "unit0" in report and "gather padded" in report and "gather two_level" in report
    many = _plan([_gpt_layer(64, (r % 8, 1, 2, 3)) for r in range(FULL_TABLE_MAX_UNITS + 1)], 8)
    many.collectives = choose_collectives(many, 8, "nccl")
    assert f"{FULL_TABLE_MAX_UNITS + 1:>5} units gather padded" in many.report()


def _agreement_with(monkeypatch, plan, other_digest: str) -> None:
    """verify_plan_agreement on a 2-rank group whose other rank sent ``other_digest``."""
    monkeypatch.setattr(verify.dist, "get_world_size", lambda group=None: 2)

    def all_gather_object(out, mine, group=None):
        out[:] = [mine, other_digest]

    monkeypatch.setattr(verify.dist, "all_gather_object", all_gather_object)
    verify.verify_plan_agreement(plan, group=object())


def test_agreement_check_catches_a_rank_with_another_choice_but_the_layout_digest_is_unchanged(monkeypatch):
    units = [_gpt_layer(64, (0, 1, 2, 3)), _gpt_layer(4096, (4, 5, 6, 7))]
    mine, theirs = _plan(units, 1024), _plan(units, 1024)
    layout_digest = mine.digest()
    mine.collectives = choose_collectives(mine, 8, "nccl")
    theirs.collectives = choose_collectives(theirs, 8, "nccl", "parts")
    assert mine.digest() == theirs.digest() == layout_digest  # what a checkpoint compares: unchanged
    assert mine.agreement_digest() != theirs.agreement_digest()
    _agreement_with(monkeypatch, mine, mine.agreement_digest())  # agreeing ranks pass
    with pytest.raises(RuntimeError, match="collective algorithms"):
        _agreement_with(monkeypatch, mine, theirs.agreement_digest())
    bare = _plan(units, 1024)
    assert bare.agreement_digest() == layout_digest  # no choice yet: the layout alone, as before


def test_chain_chunk_is_the_runtime_chains():
    from megatron_mfsdp.runtime.chain import CHUNK_BYTES

    assert CHAIN_CHUNK_BYTES == CHUNK_BYTES == NCCL_A100.chain_chunk_bytes


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--mfsdp-collectives", "bogus"], "argument --mfsdp-collectives: invalid choice: 'bogus'"),
        (["--mfsdp-collectives", "padded"], "--mfsdp-collectives padded needs --use-matrix-fsdp"),
        (
            ["--mfsdp-collectives", "two-level", "--use-matrix-fsdp", "--mfsdp-reduce-order", "rank"],
            "--mfsdp-collectives two-level with --mfsdp-reduce-order rank: the two-level reduction sums",
        ),
    ],
)
def test_collectives_flag_refuses(flags, message, capsys):
    assert message in parse_error(TINY + flags, capsys)


def test_collectives_flag_reaches_the_runtime_config():
    from megatron_mfsdp.training.setup import runtime_config

    assert runtime_config(parse_flags(TINY + ["--use-matrix-fsdp"])).collectives == "auto"
    args = parse_flags(TINY + ["--use-matrix-fsdp", "--mfsdp-collectives", "padded", "--mfsdp-reduce-order", "ring"])
    assert runtime_config(args).collectives == "padded"
