"""Bitwise check of megatron_mfsdp.precision.fp8 against Transformer Engine's quantizers on
a GPU: random bf16 weights are quantized by TE (Float8CurrentScalingQuantizer for
tensorwise, Float8BlockQuantizer with 128x128 power-of-2 blocks for blockwise, and
Float8Quantizer with a given scale for delayed) and by ours, on CUDA and on the CPU.

One line per (recipe, shape) says whether the payload bytes, the fp32 scale-inverses and
the bf16 dequantization are bitwise equal. Exit status 1 if any payload or scale differs.
Without CUDA or transformer_engine it prints one 'skipped: ...' line and exits 0.

    python benchmarks/gpu_fp8_te_check.py [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

PER_TENSOR_SHAPES = [(128, 128), (1000, 333), (1024, 1024), (4096, 1024), (2048, 5632)]
BLOCK_SHAPES = [(128, 128), (256, 384), (1024, 1024), (4096, 1024), (2048, 5632)]


def _missing() -> list[str]:
    missing = [] if torch.cuda.is_available() else ["no CUDA"]
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append("no transformer_engine")
    return missing


def _weights(shape, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(shape, generator=gen, device="cuda") * 0.02
    w[0, 0] = 0.5  # an outlier, so the amax is not a typical value
    return w.bfloat16()


def _te_tensorwise(w):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device=w.device, rowwise=True, columnwise=False)
    t = quantizer(w)
    return t._data.view(torch.uint8), t._scale_inv.reshape(1), t.dequantize(dtype=torch.bfloat16)


def _te_blockwise(w):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(
        tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, force_pow_2_scales=True, block_scaling_dim=2
    )
    t = quantizer(w)
    cols = -(-w.shape[1] // 128)
    return t._rowwise_data.view(torch.uint8), t._rowwise_scale_inv[:, :cols], t.dequantize(dtype=torch.bfloat16)


def _te_delayed(w, scale):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    amax = torch.zeros(1, dtype=torch.float32, device=w.device)
    quantizer = Float8Quantizer(scale.reshape(1).clone(), amax, tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)
    t = quantizer(w)
    return t._data.view(torch.uint8), t._scale_inv.reshape(1), t.dequantize(dtype=torch.bfloat16)


def _ours(w, recipe, scale=None):
    from megatron_mfsdp.precision import Fp8Config, dequantize, new_delayed_state, quantize

    config = Fp8Config(fp8="e4m3", fp8_recipe=recipe)
    state = new_delayed_state(config, device=w.device) if recipe == "delayed" else None
    if scale is not None:
        state[0] = scale.to(w.device)  # quantize with this stored scale
    q = quantize(w, config, state)
    return q.data, q.scale_inv, dequantize(q, torch.bfloat16)


def _word(equal: bool) -> str:
    return "equal" if equal else "DIFFER"


def _compare(recipe, shape, seed) -> bool:
    w = _weights(shape, seed)
    scale = None
    if recipe == "delayed":  # a stale scale 1.3x the fitted one: the largest values saturate
        from megatron_mfsdp.precision import scale_from_amax, weight_amax

        scale = (scale_from_amax(weight_amax(w)) * 1.3).reshape(1)
        te = _te_delayed(w, scale)
    else:
        te = (_te_tensorwise if recipe == "tensorwise" else _te_blockwise)(w)
    ours = _ours(w, recipe, scale)
    on_cpu = _ours(w.cpu(), recipe, None if scale is None else scale.cpu())
    data_eq = torch.equal(ours[0], te[0])
    scale_eq = torch.equal(ours[1].float().view(torch.int32), te[1].float().contiguous().view(torch.int32))
    deq_eq = torch.equal(ours[2].view(torch.int16), te[2].view(torch.int16))
    cpu_eq = torch.equal(on_cpu[0], ours[0].cpu()) and torch.equal(on_cpu[1], ours[1].cpu())
    differ = int((ours[0] != te[0]).sum()) if ours[0].shape == te[0].shape else -1
    print(
        f"{recipe:10s} {str(shape):13s} payload {_word(data_eq)}"
        + ("" if data_eq else f" ({differ} bytes)")
        + f", scale_inv {_word(scale_eq)}, dequantize {_word(deq_eq)}, cpu==cuda {_word(cpu_eq)}"
    )
    return data_eq and scale_eq


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        print("skipped: " + " / ".join(missing))
        return 0
    import transformer_engine

    device = torch.cuda.get_device_name()
    print(f"transformer_engine {transformer_engine.__version__}, torch {torch.__version__}, {device}")
    ok = True
    cases = [(r, s) for r in ("tensorwise", "delayed") for s in PER_TENSOR_SHAPES]
    cases += [("blockwise", s) for s in BLOCK_SHAPES]
    for i, (recipe, shape) in enumerate(cases):
        try:
            ok &= _compare(recipe, shape, args.seed + i)
        except (ImportError, AttributeError) as error:  # an older TE without this quantizer
            print(f"{recipe:10s} {str(shape):13s} not available in this transformer_engine: {error!r}")
        except Exception as error:  # noqa: BLE001 - report every case, then fail
            print(f"{recipe:10s} {str(shape):13s} ERROR {error!r}")
            ok = False
    print("all bitwise equal" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
