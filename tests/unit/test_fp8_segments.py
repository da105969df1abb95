"""FP8 owner segments on one process (precision/segments.py): the byte layout, the owner's
encode and every rank's decode, bf16 layers, and the TE fallback on a machine without TE."""

import pytest
import torch

from megatron_mfsdp.placement.classes import SLICE, WHOLE
from megatron_mfsdp.placement.layout import ParamSpec, UnitSpec
from megatron_mfsdp.placement.planner import plan_units
from megatron_mfsdp.precision import (
    Fp8Config,
    UnitCodec,
    dequantize,
    fp8_slot_names,
    in_bf16_layers,
    new_fp8_state,
    packed_nbytes,
    quantize,
    te_available,
    te_float8_weight,
)

pytestmark = pytest.mark.unit

SPECS = [
    ParamSpec("layers.0.qkv.weight", (256, 128), "muon", WHOLE, 10),
    ParamSpec("layers.0.fc1.weight", (128, 128), "muon", WHOLE, 5),
    ParamSpec("layers.0.odd.weight", (3, 5), "muon", WHOLE, 1),  # 15 bytes: the tail after it is unaligned
    ParamSpec("layers.0.norm.weight", (128,), "adamw", SLICE),
    ParamSpec("layers.0.qkv.bias", (7,), "adamw", SLICE),
]


def _unit(world, recipe="tensorwise"):
    layout = plan_units([UnitSpec("layer", SPECS)], world, "greedy").units[0]
    torch.manual_seed(0)
    values = {s.name: torch.randn(s.shape) * 0.02 for s in layout.slots}
    names = {s.name for s in layout.slots if s.storage == WHOLE and (recipe != "blockwise" or s.shape[0] >= 128)}
    return layout, values, names


def _segments(layout, values, names, config):
    """Every rank encodes its segment from an fp32 master of the values; returns the full gathered bytes."""
    full_values = torch.empty(layout.numel)
    for s in layout.slots:
        full_values[s.offset : s.offset + s.numel] = values[s.name].reshape(-1)
    codecs = [UnitCodec(layout, r, names, config, torch.bfloat16) for r in range(layout.world_size)]
    full = torch.empty(codecs[0].wire.numel, dtype=torch.uint8)
    for r, codec in enumerate(codecs):
        (m0, m1), (t0, t1) = layout.matrix_range(r), layout.tail_range(r)
        master = torch.cat([full_values[m0:m1], full_values[t0:t1]])
        segment = torch.empty(codec.segment_nbytes(), dtype=torch.uint8)
        states = {n: new_fp8_state(config) for n in names}
        codec.encode(segment, master, states, advance=True)
        (w0, w1), (v0, v1) = codec.wire.matrix_range(r), codec.wire.tail_range(r)
        full[w0:w1], full[v0:v1] = segment[: w1 - w0], segment[w1 - w0 :]  # what the gather assembles
    return codecs, full


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_bytes_and_decode_equal_the_owners_quantization(world, recipe):
    layout, values, names = _unit(world, recipe)
    config = Fp8Config(fp8_recipe=recipe)
    codecs, full = _segments(layout, values, names, config)
    wire = codecs[0].wire
    expected_matrix = sum(
        packed_nbytes(s.shape, recipe) if s.name in names else 2 * s.numel for s in layout.slots if s.storage == WHOLE
    )
    assert wire.matrix_numel == expected_matrix and wire.tail_numel == 2 * layout.tail_numel
    assert sum(c.segment_nbytes() for c in codecs) == wire.numel  # segments tile the unit exactly
    for codec in codecs:
        decoded = codec.decode(full)
        for s in layout.slots:
            if s.name in names:  # a fresh delayed state quantizes with the weight's own amax, like tensorwise
                first = config if recipe != "delayed" else Fp8Config(fp8_recipe="tensorwise")
                want = dequantize(quantize(values[s.name], first), torch.bfloat16)
            else:
                want = values[s.name].to(torch.bfloat16)
            assert decoded[s.name].dtype == torch.bfloat16 and torch.equal(decoded[s.name], want), s.name


def test_owned_weight_reads_the_owners_segment():
    layout, values, names = _unit(2)
    config = Fp8Config(fp8_recipe="tensorwise")
    codecs, full = _segments(layout, values, names, config)
    for codec in codecs:
        for rec in codec.owned_matrices():
            if rec.fp8:
                mine, gathered = codec.weight(full, rec.slot.name), quantize(values[rec.slot.name], config)
                assert torch.equal(mine.data, gathered.data) and torch.equal(mine.scale_inv, gathered.scale_inv)


def test_delayed_rederivation_reuses_the_scale_and_keeps_the_history():
    layout, values, names = _unit(1, "delayed")
    config = Fp8Config(fp8_recipe="delayed", fp8_amax_history_len=4)
    codec = UnitCodec(layout, 0, names, config, torch.bfloat16)
    master = torch.cat([values[s.name].reshape(-1) for s in sorted(layout.slots, key=lambda s: s.offset)])
    states = {n: new_fp8_state(config) for n in names}
    segment = torch.empty(codec.segment_nbytes(), dtype=torch.uint8)
    codec.encode(segment, master, states, advance=True)
    master.mul_(3.0)  # the weight grew: the next delayed scale saturates, a re-derivation reuses the old one
    codec.encode(segment, master, states, advance=True)
    made, history = segment.clone(), {n: s["delayed"].clone() for n, s in states.items()}
    segment.zero_()
    codec.encode(segment, master, states, advance=False)
    assert torch.equal(segment, made)
    assert all(torch.equal(states[n]["delayed"], history[n]) for n in names)


def test_bf16_layers_follow_megatrons_global_layer_numbers():
    assert [in_bf16_layers(f"decoder.layers.{i}.mlp.linear_fc1.weight", 4, (1, 1)) for i in range(4)] == [
        True,
        False,
        False,
        True,
    ]
    assert not in_bf16_layers("embedding.word_embeddings.weight", 4, (1, 1))
    layout, _, _ = _unit(1)
    assert fp8_slot_names(layout, {}, 2, (1, 0)) == set()
    assert fp8_slot_names(layout, {}, 2, (0, 0)) == {s.name for s in layout.slots if s.storage == WHOLE}


def test_blockwise_codec_refuses_a_misaligned_matrix():
    layout, _, _ = _unit(1)
    with pytest.raises(ValueError, match="divisible by 128"):
        UnitCodec(layout, 0, {"layers.0.odd.weight"}, Fp8Config(fp8_recipe="blockwise"), torch.bfloat16)


def test_without_transformer_engine_the_weight_is_dequantized():
    weight = quantize(torch.randn(128, 128), Fp8Config(fp8_recipe="tensorwise"))
    assert not te_available()  # this machine: no CUDA, no TE (the TE tensor path is untested here)
    assert torch.equal(te_float8_weight(weight, torch.bfloat16), dequantize(weight, torch.bfloat16))
