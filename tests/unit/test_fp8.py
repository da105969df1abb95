"""CPU tests for megatron_mfsdp.precision.fp8: TE's scale rules (transformer_engine v2.9,
common/recipe/recipe_common.cuh and delayed_scaling.cu), the saturating cast, blockwise
power-of-2 scales, delayed history, the uint8 wire format, and measured errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import pathlib
import runpy

import pytest
import torch

from megatron_mfsdp.precision import (
    BLOCK,
    E4M3_MAX,
    Fp8Config,
    Fp8Weight,
    check_shape,
    dequantize,
    from_uint8_bytes,
    new_delayed_state,
    packed_nbytes,
    quantization_error,
    quantize,
    record_amax,
    scale_from_amax,
    to_uint8_bytes,
    weight_amax,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ("tensorwise", "blockwise", "delayed")
FLT_MAX = torch.finfo(torch.float32).max


def _config(recipe, **kw):
    return Fp8Config(fp8="e4m3", fp8_recipe=recipe, **kw)


def _quantize(weight, recipe, **kw):
    config = _config(recipe, **kw)
    return quantize(weight, config, new_delayed_state(config) if recipe == "delayed" else None)


def _finite_e4m3():
    """Every finite e4m3 value (254 of them, +-0 included) and its byte, as torch decodes them."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    keep = ~torch.isnan(values)
    return values[keep], codes[keep]


def _bits(x):
    return x.contiguous().view(torch.int32)


# ---- the scale rule ---------------------------------------------------------------------


def test_scale_rule_matches_te_compute_scale_from_amax():
    """scale = 448 / amax in fp32; 0, negative, inf, NaN -> 1; an infinite scale -> FLT_MAX."""
    amax = torch.tensor([2.0, 0.3, 0.0, -1.0, math.inf, math.nan, 1e-38, 448.0])
    scale = scale_from_amax(amax)
    expected = torch.tensor([224.0, 448.0 / torch.tensor(0.3).item(), 1, 1, 1, 1, FLT_MAX, 1.0])
    assert torch.equal(scale[[0, 2, 3, 4, 5, 6, 7]], expected[[0, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(scale[1], torch.tensor(448.0) / torch.tensor(0.3))  # one fp32 division
    assert scale.dtype == torch.float32


def test_power_of_2_mode_clears_the_mantissa():
    amax = torch.tensor([3.0, 448.0, 0.02, 1e-38, 0.0, 1000.0])
    scale = scale_from_amax(amax, power_of_2=True)
    assert torch.equal(_bits(scale) & 0x7FFFFF, torch.zeros(6, dtype=torch.int32))
    expected = [2.0 ** math.floor(math.log2(448.0 / a)) for a in (3.0, 448.0, 0.02)] + [2.0**127, 1.0, 0.25]
    assert scale.tolist() == expected  # 1e-38: FLT_MAX masked to 2**127, as TE


# ---- the cast -----------------------------------------------------------------------------


def test_every_finite_e4m3_value_keeps_its_byte_and_midpoints_round_to_even():
    """With amax 448 the scale is 1: each e4m3 value maps to its own byte, and the midpoint of
    two neighbours goes to the one with the even byte (round to nearest even, as cvt.rn)."""
    values, codes = _finite_e4m3()
    q = _quantize(values, "tensorwise")
    assert q.scale_inv.item() == 1.0
    assert torch.equal(q.data, codes)
    positive = values[(values >= 0) & (codes < 0x80)]
    lower, upper = positive[:-1], positive[1:]
    mid = torch.cat([(lower + upper) / 2, torch.tensor([E4M3_MAX])])  # 448 keeps scale 1
    got = _quantize(mid, "tensorwise").data[:-1].to(torch.int32)
    low_code = torch.arange(len(lower), dtype=torch.int32)  # positive codes are 0, 1, 2, ...
    assert torch.equal(got, torch.where(low_code % 2 == 0, low_code, low_code + 1))


def test_saturation_beyond_448_with_a_stale_delayed_scale():
    """Values past +-448 (a scale that no longer fits) saturate to +-448, never inf or NaN."""
    config = _config("delayed")
    state = new_delayed_state(config)
    record_amax(state, torch.tensor(448.0), config)  # scale 1
    x = torch.tensor([448.0, 456.0, 464.0, 480.0, 500.0, 1e6, -1e6, -449.0, 0.5])
    q = quantize(x, config, state)
    assert q.scale_inv.item() == 1.0
    assert q.data.tolist() == [0x7E] * 6 + [0xFE, 0xFE, 0x30]
    assert dequantize(q, torch.float32).tolist() == [448.0] * 6 + [-448.0, -448.0, 0.5]


def test_the_amax_element_lands_on_448():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    q = _quantize(w, "tensorwise")
    payload = q.data.view(torch.float8_e4m3fn).float()
    index = w.bfloat16().abs().argmax()
    assert payload.abs().max().item() == E4M3_MAX and payload.flatten()[index].abs().item() == E4M3_MAX


def test_amax_zero_gives_scale_1():
    for recipe in RECIPES:
        q = _quantize(torch.zeros(256, 128), recipe)
        assert torch.equal(q.scale_inv, torch.ones_like(q.scale_inv)) and not q.data.any()
        assert not dequantize(q).any()
    w = torch.randn(256, 256)
    w[128:, :128] = 0
    q = _quantize(w, "blockwise")
    assert q.scale_inv[1, 0].item() == 1.0 and q.scale_inv[0, 0].item() != 1.0


def test_inf_gives_scale_1_and_saturates():
    x = torch.tensor([math.inf, -math.inf, 1000.0, 0.25, -3.0])
    q = _quantize(x, "tensorwise")
    assert q.scale_inv.item() == 1.0
    assert dequantize(q, torch.float32).tolist() == [448.0, -448.0, 448.0, 0.25, -3.0]


def test_nan_stays_nan_and_is_ignored_by_amax():
    """TE's amax uses __hmax / fmaxf, which skip NaN: the other values keep a fitted scale."""
    x = torch.tensor([math.nan, 1.0, -2.0, 0.5])
    q = _quantize(x, "tensorwise")
    assert torch.equal(q.scale_inv, torch.reciprocal(torch.tensor([224.0])))
    out = dequantize(q, torch.float32)
    assert math.isnan(out[0]) and out[1:].tolist() == [1.0, -2.0, 0.5]
    assert (q.data[0] & 0x7F).item() == 0x7F  # e4m3fn's NaN pattern
    assert _quantize(torch.full((3,), math.nan), "tensorwise").scale_inv.item() == 1.0
    w = torch.ones(128, 256)
    w[5, 7] = math.nan
    qb = _quantize(w, "blockwise")
    assert torch.equal(qb.scale_inv, torch.full((1, 2), 1 / 256.0))  # 448 / 1 masked to 256
    assert torch.isnan(dequantize(qb)).sum().item() == 1


# ---- blockwise ------------------------------------------------------------------------------


def test_blockwise_scales_are_powers_of_2_from_each_block_amax():
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.tensor([[1e-3, 0.02, 1.0], [7.0, 300.0, 5e-6]])
    w = torch.randn(256, 384, generator=gen) * magnitudes.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    q = _quantize(w, "blockwise")
    assert q.scale_inv.shape == (2, 3) and q.scale_inv.dtype == torch.float32
    scale = torch.reciprocal(q.scale_inv)
    assert torch.equal(_bits(scale) & 0x7FFFFF, torch.zeros(2, 3, dtype=torch.int32))
    amax = w.bfloat16().double().abs().reshape(2, BLOCK, 3, BLOCK).amax(dim=(1, 3))
    limit = E4M3_MAX / amax
    assert bool((scale.double() <= limit).all()) and bool((limit < 2 * scale.double()).all())
    assert len(set(q.scale_inv.flatten().tolist())) == 6


@pytest.mark.parametrize("shape,dim", [((256, 200), 1), ((100, 256), 0), ((130, 130), 0)])
def test_blockwise_rejects_misaligned_shapes(shape, dim):
    with pytest.raises(ValueError, match=rf"blockwise.*128.*dimension {dim} \({shape[dim]}\)"):
        _quantize(torch.randn(shape), "blockwise")
    with pytest.raises(ValueError, match="qkv"):
        check_shape(shape, "blockwise", name="qkv")
    check_shape(shape, "tensorwise")  # per-tensor recipes take any shape
    assert _quantize(torch.randn(shape), "tensorwise").data.shape == shape


def test_blockwise_needs_2d():
    with pytest.raises(ValueError, match="2D"):
        check_shape((128, 128, 128), "blockwise")


# ---- exactness, determinism, wire format ------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("exponent", [-14, -3, 0, 6])
def test_e4m3_values_times_a_power_of_2_round_trip_exactly(recipe, exponent):
    values, _ = _finite_e4m3()
    blocks = torch.cat([values, torch.zeros(BLOCK * BLOCK - len(values))]).reshape(BLOCK, BLOCK)
    w = blocks * 2.0**exponent
    if recipe == "blockwise":  # a second block with its own scale
        w = torch.cat([w, blocks * 2.0 ** (exponent - 5)], dim=1)
    if recipe == "delayed":
        config = _config("delayed")
        state = new_delayed_state(config)
        record_amax(state, torch.tensor(E4M3_MAX * 2.0**exponent), config)
        q = quantize(w, config, state)
    else:
        q = _quantize(w, recipe)
    assert torch.equal(dequantize(q, torch.float32), w)
    assert torch.equal(dequantize(q, torch.bfloat16), w.bfloat16())


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_calls_are_bitwise_equal(recipe):
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(4))
    a, b = _quantize(w, recipe), _quantize(w.clone(), recipe)
    assert torch.equal(a.data, b.data) and torch.equal(_bits(a.scale_inv), _bits(b.scale_inv))
    assert torch.equal(dequantize(a).view(torch.int16), dequantize(b).view(torch.int16))


def test_master_goes_through_bf16():
    """An fp32 master and its bf16 copy quantize to the same bytes (TE casts the bf16 weight)."""
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
    for recipe in RECIPES:
        a, b = _quantize(w, recipe), _quantize(w.bfloat16(), recipe)
        assert torch.equal(a.data, b.data) and torch.equal(a.scale_inv, b.scale_inv)
    assert weight_amax(w) == w.bfloat16().abs().max().float()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("offset", [0, 3])
def test_uint8_round_trip_is_bitwise(recipe, offset):
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(6))
    w[0, 0] = math.nan
    q = _quantize(w, recipe)
    packed = to_uint8_bytes(q)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(w.shape, recipe)
    assert packed.numel() == 4 * q.scale_inv.numel() + w.numel()
    wire = torch.cat([torch.full((offset,), 7, dtype=torch.uint8), packed, torch.zeros(5, dtype=torch.uint8)])
    back = from_uint8_bytes(wire[offset:], w.shape, recipe)
    assert torch.equal(back.data, q.data) and torch.equal(_bits(back.scale_inv), _bits(q.scale_inv))
    assert torch.equal(dequantize(back).view(torch.int16), dequantize(q).view(torch.int16))
    assert torch.equal(packed[: 4 * q.scale_inv.numel()].clone().view(torch.float32), q.scale_inv.flatten())


def test_uint8_buffer_errors_name_the_need():
    with pytest.raises(ValueError, match="at least 65552 bytes"):
        from_uint8_bytes(torch.zeros(100, dtype=torch.uint8), (256, 256), "blockwise")
    with pytest.raises(ValueError, match="uint8"):
        from_uint8_bytes(torch.zeros(100, dtype=torch.float32), (4, 4), "tensorwise")


# ---- delayed scaling ------------------------------------------------------------------------


def _weight_with_amax(amax):
    return torch.tensor([[amax, -amax / 2, 0.1 * amax, 0.0]])


@pytest.mark.parametrize(
    "algo,length,expected",
    [
        ("most_recent", 1, [448.0, 448.0 / 4, 448.0 / 2, 448.0]),
        ("most_recent", 3, [448.0, 448.0 / 4, 448.0 / 2, 448.0]),
        ("max", 2, [448.0, 448.0 / 4, 448.0 / 4, 448.0 / 2]),
        ("max", 3, [448.0, 448.0 / 4, 448.0 / 4, 448.0 / 4]),
    ],
)
def test_delayed_history(algo, length, expected):
    """Each quantization uses the scale from the amaxes seen before it (amaxes 1, 4, 2, 1);
    the first one, from a fresh state, uses its own amax."""
    config = _config("delayed", fp8_amax_history_len=length, fp8_amax_compute_algo=algo)
    state = new_delayed_state(config)
    scale_inv = torch.cat([quantize(_weight_with_amax(a), config, state).scale_inv for a in (1.0, 4.0, 2.0, 1.0)])
    used = [448.0] + expected[:3]  # the second weight (amax 4) saturates under the first scale
    assert torch.equal(scale_inv, torch.reciprocal(torch.tensor(used)))
    assert state[0].item() == expected[3]
    assert state[1:].tolist() == ([1.0, 2.0, 4.0][:length])


def test_delayed_saturates_when_the_weight_grew():
    config = _config("delayed")
    state = new_delayed_state(config)
    quantize(_weight_with_amax(1.0), config, state)
    q = quantize(_weight_with_amax(4.0), config, state)
    assert dequantize(q, torch.float32)[0, 0].item() == 1.0  # 4 * 448 saturated to 448, times 1/448


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_delayed_margin(margin):
    config = _config("delayed", fp8_margin=margin)
    state = new_delayed_state(config)
    amax = torch.tensor(0.37).bfloat16().float()
    q = quantize(_weight_with_amax(amax.item()), config, state)
    expected = torch.tensor(E4M3_MAX * 2.0**-margin) / amax
    assert torch.equal(state[:1], expected.reshape(1))
    assert torch.equal(q.scale_inv, torch.reciprocal(expected).reshape(1))


def test_delayed_keeps_the_previous_scale_on_zero_inf_nan_amax():
    config = _config("delayed", fp8_amax_history_len=1)
    state = new_delayed_state(config)
    assert torch.equal(_quantize(torch.zeros(2, 2), "delayed").scale_inv, torch.ones(1))  # fresh: 1
    record_amax(state, torch.tensor(2.0), config)
    for bad in (0.0, math.inf, math.nan):
        record_amax(state, torch.tensor(bad), config)
        assert state[0].item() == 224.0
    record_amax(state, torch.tensor(1e-38), config)
    assert state[0].item() == FLT_MAX


def test_delayed_state_checkpoints_as_one_tensor():
    config = _config("delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
    state = new_delayed_state(config)
    gen = torch.Generator().manual_seed(8)
    weights = [torch.randn(64, 32, generator=gen) * (1 + i) for i in range(6)]
    for w in weights[:3]:
        quantize(w, config, state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    resumed = torch.load(io.BytesIO(buffer.getvalue()))
    assert resumed.shape == (5,) and resumed.dtype == torch.float32
    for w in weights[3:]:
        a, b = quantize(w, config, state), quantize(w, config, resumed)
        assert torch.equal(a.data, b.data) and torch.equal(a.scale_inv, b.scale_inv)
    assert torch.equal(state, resumed)


def test_delayed_state_errors():
    config = _config("delayed", fp8_amax_history_len=2)
    with pytest.raises(ValueError, match="new_delayed_state"):
        quantize(torch.ones(2, 2), config)
    with pytest.raises(ValueError, match="--fp8-amax-history-len 2"):
        quantize(torch.ones(2, 2), config, torch.zeros(5))


# ---- errors against the update --------------------------------------------------------


@pytest.mark.parametrize("recipe,low,high", [("tensorwise", 0.0260, 0.0270), ("blockwise", 0.0260, 0.0272)])
def test_measured_relative_error_of_random_weights(recipe, low, high):
    """||dq(q(W)) - W|| / ||W|| of N(0, 0.02) 1024x1024 weights (measured 2.650% tensorwise,
    2.666% blockwise with power-of-2 scales, seed 0)."""
    w = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    error = quantization_error(w, _quantize(w, recipe), update=w).item()
    print(f"fp8 {recipe} relative error of N(0, 0.02) 1024x1024: {100 * error:.3f}%")
    assert low < error < high


def test_quantization_error_against_the_update():
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(9))
    update = 1e-3 * torch.randn(256, 128, generator=torch.Generator().manual_seed(10))
    for recipe in RECIPES:
        q = _quantize(w, recipe)
        expected = (dequantize(q, torch.float32).double() - w.double()).norm() / update.double().norm()
        got = quantization_error(w, q, update)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert math.isclose(got.item(), expected.item(), rel_tol=1e-5) and got.item() > 1
    exact = torch.tensor([[448.0, 1.0, -0.5]])
    q = _quantize(exact, "tensorwise")
    assert quantization_error(exact, q, update=torch.ones(1, 3)).item() == 0.0
    assert quantization_error(exact, q, update=torch.zeros(1, 3)).item() == 0.0
    assert quantization_error(w, _quantize(w, "tensorwise"), update=torch.zeros_like(w)).item() == math.inf


# ---- flags ------------------------------------------------------------------------------


def test_mxfp8_is_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"--fp8-recipe mxfp8.*1x32.*e8m0.*second quantization"):
        Fp8Config(fp8="e4m3", fp8_recipe="mxfp8")
    with pytest.raises(NotImplementedError, match="--fp8-quantizer-factory"):
        Fp8Config(fp8="e4m3", fp8_recipe="custom")


@pytest.mark.parametrize(
    "kw,flag",
    [
        ({"fp8": "e5m2"}, "--fp8-format"),
        ({"fp8_recipe": "rowwise"}, "--fp8-recipe"),
        ({"fp8_amax_compute_algo": "mean"}, "--fp8-amax-compute-algo"),
        ({"fp8_amax_history_len": 0}, "--fp8-amax-history-len"),
    ],
)
def test_bad_flags_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Fp8Config(**kw)


def test_config_reads_megatron_args_and_defaults():
    """Dest names and defaults as megatron/core/transformer/transformer_config.py (core_v0.16.1)."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mfsdp.training.configs import fp8_config_from_args

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(Fp8Config)}
    assert all(ours[name] == defaults[name] for name in ours if name != "fp8")
    assert fp8_config_from_args(argparse.Namespace(fp8=None, fp8_recipe="delayed")) is None
    args = argparse.Namespace(
        fp8="hybrid", fp8_recipe=Fp8Recipe.blockwise, fp8_margin=1, fp8_amax_history_len=8, fp8_amax_compute_algo="max"
    )
    config = fp8_config_from_args(args)
    assert config == Fp8Config("hybrid", "blockwise", 1, 8, "max") and type(config.fp8_recipe) is str
    assert config.fp8_max == E4M3_MAX
    q = quantize(torch.randn(128, 128), config)
    assert isinstance(q, Fp8Weight) and q.recipe == "blockwise"


def test_gpu_check_script_skips_cleanly_here():
    """benchmarks/gpu_fp8_te_check.py: one 'skipped:' line and status 0 without CUDA or TE."""
    script = runpy.run_path(str(ROOT / "benchmarks" / "gpu_fp8_te_check.py"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = script["main"]([])
    lines = out.getvalue().splitlines()
    if lines and lines[0].startswith("skipped:"):
        assert status == 0 and len(lines) == 1 and ("no CUDA" in lines[0] or "no transformer_engine" in lines[0])
    else:
        assert status == 0, out.getvalue()
