"""Newton-Schulz kernels on one owner's matrices: the standard iteration with torch's calls
(what --muon-ns-algorithm standard and the paper's code run), the same with the symmetric
products by block rows, the Gram-space iteration, and what auto runs on this machine. Shapes
are one layer of issue 11's GPT (hidden 512, FFN 2048, fused QKV as the paper orthogonalizes
it), repeated; rounds interleave the kernels so that a slow spell of the machine hits all alike.
Prints the median milliseconds per kernel and dtype and the ratios to the plain standard one.

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

from megatron_mfsdp.optim import muon  # noqa: E402


def kernels(dtype: torch.dtype) -> dict:
    """name -> kernel of one matrix (5 steps, torch's 'simple' coefficients)."""

    def run(kernel, symmetric: bool):
        return lambda g: kernel(g, 5, "simple", dtype, symmetric=symmetric)

    return {
        "standard": run(muon.newton_schulz, False),
        "standard+sym": run(muon.newton_schulz, True),
        "gram": run(muon.newton_schulz_gram, False),
        "gram+sym": run(muon.newton_schulz_gram, True),
        "auto": lambda g: muon.orthogonalize(g, 5, "simple", dtype, "auto"),
    }


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
        for _ in range(args.rounds + 1):  # the first round warms up
            for k, fn in runs.items():
                start = time.perf_counter()
                for g in matrices:
                    fn(g)
                times[k].append(time.perf_counter() - start)
        base = statistics.median(times["standard"][1:])
        row = " ".join(f"{k} {statistics.median(v[1:]) * 1e3:7.1f} ms" for k, v in times.items())
        print(f"{name}: {row}")
        speedups = " ".join(f"{k}={base / statistics.median(v[1:]):.3f}" for k, v in times.items() if k != "standard")
        print(f"RESULT dtype={name} standard_over: {speedups}")


if __name__ == "__main__":
    main()
