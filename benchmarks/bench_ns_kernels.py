"""Newton-Schulz kernels on one owner's matrices: the standard iteration with torch's calls
(what --muon-ns-algorithm standard and the paper's code run), the same with the symmetric
products by block rows, the Gram-space iteration, and what auto runs on this machine. Shapes
are one layer of issue 11's GPT (hidden 512, FFN 2048, fused QKV as the paper orthogonalizes
it), repeated; rounds interleave the kernels so that a slow spell of the machine hits all alike.
Prints the median milliseconds per kernel and dtype and the ratios to the plain standard one,
and the bf16 step (auto in bf16: what training runs by default where bf16 is chosen) against the
bare time of its matrix products: the same torch.mm/addmm calls on operands of the same shapes,
strides and dtype, nothing else: the ratio says what the step costs beyond its products (1: nothing).

    .venv/bin/python benchmarks/bench_ns_kernels.py [--hidden 512 --layers 2 --rounds 7]

Run two at once (one per core) to see it as the W=2 step does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from megatron_mfsdp.optim import newton_schulz as muon  # noqa: E402

STEPS, COEFFICIENTS = 5, "simple"
PRODUCTS = {
    torch.mm,
    torch.matmul,
    torch.addmm,
    torch.Tensor.mm,
    torch.Tensor.matmul,
    torch.Tensor.addmm,
    torch.Tensor.__matmul__,
}


def kernels(dtype: torch.dtype) -> dict:
    """name -> kernel of one matrix (5 steps, torch's 'simple' coefficients)."""

    def run(kernel, symmetric: bool):
        return lambda g: kernel(g, STEPS, COEFFICIENTS, dtype, symmetric=symmetric)

    return {
        "standard": run(muon.newton_schulz, False),
        "standard+sym": run(muon.newton_schulz, True),
        "gram": run(muon.newton_schulz_gram, False),
        "gram+sym": run(muon.newton_schulz_gram, True),
        "auto": lambda g: muon.orthogonalize(g, STEPS, COEFFICIENTS, dtype, "auto"),
    }


class _RecordProducts(TorchFunctionMode):
    """Every matrix product a kernel calls, as a bare call to replay: torch.mm or torch.addmm on
    fresh operands (and out=, where the kernel writes into a block) of the same shapes, strides
    and dtype. Recorded from the library's own kernel, so the list cannot drift from it."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS:
            self.calls.append(_bare_call(func, args, kwargs))
        return func(*args, **kwargs)


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).normal_()


def _bare_call(func, args, kwargs) -> tuple:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.dim() != 2 for t in tensors):
        raise SystemExit(f"bare products: {func.__name__} on a stack, not replayed as torch.mm/addmm")
    out = {"out": _like(kwargs["out"])} if kwargs.get("out") is not None else {}
    if len(tensors) == 3:  # addmm(bias, left, right)
        scale = {k: kwargs[k] for k in ("beta", "alpha") if k in kwargs}
        return torch.addmm, tuple(_like(t) for t in tensors), {**scale, **out}
    return torch.mm, tuple(_like(t) for t in tensors), out


def bare_products(g: torch.Tensor, dtype: torch.dtype):
    """The bf16 step's products of ``g`` (:func:`muon.orthogonalize`, auto), as one callable that
    makes those calls alone; checked against the library's multiply-add count
    (:func:`muon.ns_multiply_adds`, which enumerates symmetric products by its row blocks)."""
    with _RecordProducts() as recorder:
        muon.orthogonalize(g, STEPS, COEFFICIENTS, dtype, "auto")
    calls = recorder.calls
    recorded = sum(a[-2].shape[0] * a[-2].shape[1] * a[-1].shape[1] for _, a, _ in calls)
    gram = muon.uses_gram(g.shape, STEPS, dtype, "auto")
    expected = muon.ns_multiply_adds(g.shape, STEPS, dtype, gram, muon.uses_symmetric(g.shape, "auto", True))
    if recorded != expected:
        raise SystemExit(f"bare products of {tuple(g.shape)}: {recorded} multiply-adds recorded, {expected} counted")

    def run():
        for fn, a, kw in calls:
            fn(*a, **kw)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2, help="layers' matrices per round (W=2 owns 2 of 4)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    h = args.hidden
    shapes = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)] * args.layers
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.randn(s, generator=gen) for s in shapes]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {len(shapes)} matrices: {sorted(set(shapes))}")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        runs = kernels(dtype)
        times: dict[str, list[float]] = {k: [] for k in runs}
        bare = [bare_products(g, dtype) for g in matrices] if dtype == torch.bfloat16 else []
        bare_times: list[float] = []
        for _ in range(args.rounds + 1):  # the first round warms up
            for k, fn in runs.items():
                start = time.perf_counter()
                for g in matrices:
                    fn(g)
                times[k].append(time.perf_counter() - start)
            if bare:
                start = time.perf_counter()
                for run in bare:
                    run()
                bare_times.append(time.perf_counter() - start)
        base = statistics.median(times["standard"][1:])
        row = " ".join(f"{k} {statistics.median(v[1:]) * 1e3:7.1f} ms" for k, v in times.items())
        print(f"{name}: {row}")
        speedups = " ".join(f"{k}={base / statistics.median(v[1:]):.3f}" for k, v in times.items() if k != "standard")
        print(f"RESULT dtype={name} standard_over: {speedups}")
        if bare:
            step, products = statistics.median(times["auto"][1:]), statistics.median(bare_times[1:])
            print(
                f"RESULT dtype={name} ns_step_over_bare_products={step / products:.3f} "
                f"ns_step_ms={step * 1e3:.1f} bare_products_ms={products * 1e3:.1f}"
            )


if __name__ == "__main__":
    main()
