"""FP8 weights quantized by their owner: Transformer Engine's scale rules for one rank that
holds the whole matrix, so no amax collective is needed anywhere.

The owner quantizes its fp32 master through bf16 (master -> bf16 -> e4m3), as Transformer
Engine casts a bf16 weight, with scales from its own amax. The gather moves the e4m3 bytes
as uint8 (gloo rejects float8 dtypes) plus a few fp32 scale-inverses; every rank runs the
same fp32 multiply in ``dequantize``, so all ranks hold bitwise identical weights.

Facts matched, Transformer Engine v2.9 (read, not copied):
- common/recipe/recipe_common.cuh, ``compute_scale_from_amax``: scale = fp8_max / amax in
  fp32 (``__fdiv_rn``, IEEE division); amax 0, inf or NaN gives 1 (amax_epsilon is 0.0 in
  every recipe, common/recipe/__init__.py); an infinite scale becomes FLT_MAX; power-of-2
  mode keeps only the sign and exponent bits of the scale (``& 0xFF800000``).
- common/recipe/current_scaling.cu and pytorch/csrc/quantizer.cpp
  (``Float8CurrentScalingQuantizer::quantize_impl``): amax of the bf16 input, the scale
  from it, the cast ``OType(float(x) * scale)``, scale_inv = ``__frcp_rn(scale)``
  (common/utils.cuh, ``reciprocal<float>``).
- common/transpose/quantize_transpose_square_blockwise.cu: one amax per 128x128 tile
  (``fmaxf``, so NaN is ignored, as ``__hmax`` in the tensor amax), power-of-2 scales.
- common/recipe/delayed_scaling.cu: scaled_max = fp8_max * 2**-margin, scale =
  scaled_max / amax over the history (most_recent or max); a zero or non-finite amax keeps
  the previous scale; an infinite scale becomes FLT_MAX.
- The cast saturates (``__nv_fp8_e4m3`` converts with ``__NV_SATFINITE``): beyond +-448
  (and +-inf) gives +-448, NaN stays NaN; rounding is to nearest even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
BLOCK = 128  # Float8BlockScaling's 2D weight tile (w_block_scaling_dim=2, block_len 128)
FP8_FORMATS = ("e4m3", "hybrid")  # --fp8-format; weights are e4m3 under both
FP8_RECIPES = ("tensorwise", "blockwise", "delayed")  # the --fp8-recipe values supported here
AMAX_COMPUTE_ALGOS = ("most_recent", "max")  # --fp8-amax-compute-algo
PER_TENSOR = ("tensorwise", "delayed")

_FLT_MAX = torch.finfo(torch.float32).max
_SIGN_AND_EXPONENT = -(1 << 23)  # 0xFF800000 as a signed int32: clears the 23 mantissa bits

_UNSUPPORTED = {
    "mxfp8": (
        "--fp8-recipe mxfp8 is not supported: MXFP8 scales 1x32 blocks with e8m0 scales along rows "
        "for the forward GEMM and along columns for the transposed backward GEMM, and neither set "
        "of scales can be derived from the other, so a payload the owner quantizes once cannot serve "
        "both GEMMs without a second quantization from high precision on every rank. Use --fp8-recipe "
        "blockwise (128x128 blocks: the transpose is a byte transpose) or tensorwise"
    ),
    "custom": (
        "--fp8-recipe custom is not supported: it names a Transformer Engine quantizer factory "
        "(--fp8-quantizer-factory), while MatrixFSDP quantizes on the owner with its own math; "
        "use --fp8-recipe tensorwise, blockwise or delayed"
    ),
}


@dataclass(frozen=True)
class Fp8Config:
    """Megatron-LM's FP8 flags, by their argparse dest names (--fp8-format is ``fp8``), with
    the defaults of megatron/core/transformer/transformer_config.py at core_v0.16.1; a run's is
    built by training/configs.py fp8_config_from_args."""

    fp8: str = "e4m3"
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        for name in ("fp8", "fp8_recipe", "fp8_amax_compute_algo"):
            value = getattr(self, name)
            object.__setattr__(self, name, getattr(value, "value", value))  # megatron's str enums
        if self.fp8_recipe in _UNSUPPORTED:
            raise NotImplementedError(_UNSUPPORTED[self.fp8_recipe])
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe {self.fp8_recipe!r}: expected one of {FP8_RECIPES}")
        if self.fp8 not in FP8_FORMATS:
            raise ValueError(f"--fp8-format {self.fp8!r}: expected one of {FP8_FORMATS}")
        if self.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo!r}: expected {AMAX_COMPUTE_ALGOS}")
        if int(self.fp8_amax_history_len) < 1:
            raise ValueError(f"--fp8-amax-history-len {self.fp8_amax_history_len}: must be at least 1")
        if int(self.fp8_margin) != self.fp8_margin:
            raise ValueError(f"--fp8-margin {self.fp8_margin!r}: must be an integer")

    @property
    def fp8_max(self) -> float:
        """448: 'hybrid' keeps weights (forward tensors) in e4m3, like TE's Format.HYBRID."""
        return E4M3_MAX


@dataclass(frozen=True)
class Fp8Weight:
    """An owner-quantized matrix: what travels in the gather and what every rank dequantizes."""

    data: torch.Tensor  # uint8 e4m3 bit patterns, the matrix's shape
    scale_inv: torch.Tensor  # fp32: (1,) per tensor, (ceil(m/128), ceil(n/128)) for blockwise
    recipe: str  # the --fp8-recipe that produced it


def scale_from_amax(amax, fp8_max: float = E4M3_MAX, power_of_2: bool = False) -> torch.Tensor:
    """TE's compute_scale_from_amax, elementwise over a tensor of amaxes (fp32)."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = torch.full_like(amax, fp8_max) / amax
    scale = torch.where(torch.isinf(scale), _FLT_MAX, scale)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, 1.0)
    if power_of_2:
        scale = (scale.view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32)
    return scale


def _bf16(master: torch.Tensor) -> torch.Tensor:
    if not master.is_floating_point():
        raise TypeError(f"FP8 quantization needs a floating-point master weight, got {master.dtype}")
    return master.detach().to(torch.bfloat16)


def _abs_without_nan(weight16: torch.Tensor) -> torch.Tensor:
    magnitude = weight16.abs()
    return torch.where(torch.isnan(magnitude), 0.0, magnitude)


def weight_amax(master: torch.Tensor) -> torch.Tensor:
    """max |bf16(master)| as fp32, NaN ignored (TE's __hmax / fmaxf); 0 for an empty tensor."""
    magnitude = _abs_without_nan(_bf16(master))
    if magnitude.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=master.device)
    return magnitude.amax().float()


def _cast_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating, round-to-nearest-even cast; the clamp keeps older torch casts from giving NaN."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def check_shape(shape, recipe: str, name: str = "weight") -> None:
    """Blockwise needs a 2D weight whose TP-local dimensions are multiples of 128."""
    if recipe != "blockwise":
        return
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"--fp8-recipe blockwise quantizes 2D weights in 128x128 blocks; {name} has shape {shape}")
    for dim, size in enumerate(shape):
        if size % BLOCK:
            raise ValueError(
                f"--fp8-recipe blockwise needs every TP-local weight dimension divisible by {BLOCK} "
                f"(128x128 blocks); {name} has TP-local shape {shape}: dimension {dim} ({size}) is not. "
                f"Use sizes divisible by {BLOCK} per tensor-parallel rank, or --fp8-recipe tensorwise"
            )


def scale_inv_shape(shape, recipe: str) -> tuple[int, ...]:
    """(1,) per tensor; one scale per 128x128 block for blockwise."""
    if recipe == "blockwise":
        return (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
    return (1,)


def _per_tensor(master: torch.Tensor, scale: torch.Tensor, recipe: str) -> Fp8Weight:
    scale = scale.reshape(1).to(torch.float32)
    data = _cast_e4m3(_bf16(master).float() * scale)
    return Fp8Weight(data=data, scale_inv=torch.reciprocal(scale), recipe=recipe)


def _blockwise(master: torch.Tensor, name: str) -> Fp8Weight:
    check_shape(master.shape, "blockwise", name)
    rows, cols = master.shape
    tiles = (rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    weight16 = _bf16(master)
    amax = _abs_without_nan(weight16).reshape(tiles).amax(dim=(1, 3)).float()
    scale = scale_from_amax(amax, E4M3_MAX, power_of_2=True)
    data = _cast_e4m3(weight16.float().reshape(tiles) * scale[:, None, :, None]).reshape(rows, cols)
    return Fp8Weight(data=data, scale_inv=torch.reciprocal(scale), recipe="blockwise")


def new_delayed_state(config: Fp8Config, device=None) -> torch.Tensor:
    """A matrix's delayed-scaling state, fp32 [scale, amax history newest first], length
    --fp8-amax-history-len + 1. All zeros is a fresh state, so a zero-initialized
    optimizer-state tensor works and the state checkpoints as one small tensor."""
    return torch.zeros(int(config.fp8_amax_history_len) + 1, dtype=torch.float32, device=device)


def _delayed_rule(amax: torch.Tensor, previous: torch.Tensor, config: Fp8Config) -> torch.Tensor:
    scaled_max = torch.tensor(config.fp8_max * 2.0 ** -int(config.fp8_margin), dtype=torch.float32)
    scale = scaled_max.to(amax.device) / amax
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, previous)
    return torch.where(torch.isinf(scale), _FLT_MAX, scale)


def _stored_scale(state: torch.Tensor) -> torch.Tensor:
    return torch.where(state[:1] == 0, 1.0, state[:1])  # a fresh state has TE's initial scale 1


def record_amax(state: torch.Tensor, amax: torch.Tensor, config: Fp8Config) -> None:
    """Push one amax into the history and set the scale the next quantization uses (in place)."""
    if state.shape != (int(config.fp8_amax_history_len) + 1,) or state.dtype != torch.float32:
        raise ValueError(
            f"delayed-scaling state has shape {tuple(state.shape)} ({state.dtype}); --fp8-amax-history-len "
            f"{config.fp8_amax_history_len} needs fp32 ({int(config.fp8_amax_history_len) + 1},)"
        )
    history = state[1:]
    history.copy_(torch.cat([amax.reshape(1).to(state), history[:-1]]))
    used = history[:1] if config.fp8_amax_compute_algo == "most_recent" else history.amax().reshape(1)
    state[:1] = _delayed_rule(used, _stored_scale(state), config)


def delayed_scale(master: torch.Tensor, config: Fp8Config, state: torch.Tensor) -> torch.Tensor:
    """The (1,) scale the next delayed quantization of ``master`` uses, without changing ``state``.
    A fresh state takes its first scale from this weight rather than TE's initial 1, so the
    first forward is not quantized with scale 1; afterwards the scale is the delayed one."""
    amax = weight_amax(master).to(state.device)
    first = _delayed_rule(amax.reshape(1), torch.ones(1, device=state.device), config)
    return torch.where(state[:1] == 0, first, state[:1])


def quantize_with_scale(master: torch.Tensor, scale: torch.Tensor, recipe: str = "delayed") -> Fp8Weight:
    """Per-tensor quantization with a given fp32 scale: how a delayed-scaling payload is re-derived
    from its master after a checkpoint load, with the scale it was made with."""
    return _per_tensor(master, scale.to(master.device), recipe)


def _delayed(master: torch.Tensor, config: Fp8Config, state: torch.Tensor | None) -> Fp8Weight:
    if state is None:
        raise ValueError("--fp8-recipe delayed keeps an amax history per matrix: pass state=new_delayed_state(config)")
    quantized = _per_tensor(master, delayed_scale(master, config, state).to(master.device), "delayed")
    record_amax(state, weight_amax(master).to(state.device), config)
    return quantized


def quantize(
    master: torch.Tensor, config: Fp8Config, state: torch.Tensor | None = None, name: str = "weight"
) -> Fp8Weight:
    """Quantize one whole matrix on its owner (master -> bf16 -> e4m3). ``state`` is the
    delayed-scaling tensor of ``new_delayed_state``, updated in place; other recipes ignore it."""
    if config.fp8_recipe == "blockwise":
        return _blockwise(master, name)
    if config.fp8_recipe == "delayed":
        return _delayed(master, config, state)
    return _per_tensor(master, scale_from_amax(weight_amax(master), config.fp8_max), "tensorwise")


def dequantize(quantized: Fp8Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 value times its fp32 scale-inverse, rounded once to ``dtype``: elementwise, hence
    bitwise identical on every rank that holds the same bytes."""
    values = quantized.data.view(torch.float8_e4m3fn).float()
    if quantized.recipe != "blockwise":
        return (values * quantized.scale_inv).to(dtype)
    rows, cols = values.shape
    row_blocks, col_blocks = quantized.scale_inv.shape
    tiles = values.reshape(row_blocks, BLOCK, col_blocks, BLOCK) * quantized.scale_inv[:, None, :, None]
    return tiles.reshape(rows, cols).to(dtype)


def quantization_error(master: torch.Tensor, quantized: Fp8Weight, update: torch.Tensor) -> torch.Tensor:
    """||dequantize(q) - W||_F / ||update||_F in fp32: the FP8 rounding next to the optimizer's
    step (above 1 means the rounding outweighs the update). 0 if both are 0, inf if only the update is."""
    error = torch.linalg.vector_norm(dequantize(quantized, torch.float32) - master.detach().float())
    step = torch.linalg.vector_norm(update.detach().float()).to(error.device)
    ratio = error / torch.where(step > 0, step, 1.0)
    return torch.where(step > 0, ratio, torch.where(error > 0, math.inf, 0.0))


def packed_nbytes(shape, recipe: str) -> int:
    """Bytes of ``to_uint8_bytes``: 4 per fp32 scale-inverse, then one per element."""
    return 4 * math.prod(scale_inv_shape(shape, recipe)) + math.prod(shape)


def to_uint8_bytes(quantized: Fp8Weight) -> torch.Tensor:
    """One flat uint8 buffer: the scale-inverses first (fp32, row-major, native byte order:
    little-endian on x86 and ARM), then the e4m3 payload row-major. Scales first keep them at
    a 4-byte offset; the receiver knows shape and recipe from the plan."""
    scales = quantized.scale_inv.contiguous().view(torch.uint8).reshape(-1)
    return torch.cat([scales, quantized.data.reshape(-1)])


def from_uint8_bytes(buffer: torch.Tensor, shape, recipe: str) -> Fp8Weight:
    """Inverse of ``to_uint8_bytes`` on a uint8 buffer (which may sit at any offset of a larger
    one): the payload is a view of ``buffer``, the few scale bytes are copied to align them."""
    shape, scale_shape = tuple(shape), scale_inv_shape(shape, recipe)
    scale_bytes, needed = 4 * math.prod(scale_shape), packed_nbytes(shape, recipe)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < needed:
        raise ValueError(
            f"FP8 gather buffer: need 1D uint8 with at least {needed} bytes for {recipe} {shape}, "
            f"got {buffer.dtype} {tuple(buffer.shape)}"
        )
    scale_inv = buffer[:scale_bytes].clone().view(torch.float32).reshape(scale_shape)
    data = buffer[scale_bytes:needed].view(shape)
    return Fp8Weight(data=data, scale_inv=scale_inv, recipe=recipe)
