"""Batched owner math: the Muon step with Newton-Schulz stacked by shape against one
matrix at a time, and foreach AdamW against the loop over tail pieces, on the owner's
pieces of a GPT (4 layers, hidden 512, FFN 2048, 8 heads: issue 11's shape); prints
median times, the speedup and whether the results are bitwise equal.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_batched_ns.py [--layers 4 --hidden 512 --repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_mfsdp.optim import adamw, muon  # noqa: E402
from megatron_mfsdp.optim.rule import OwnedPiece, StepContext  # noqa: E402


def pieces(shapes, state_names, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (shape, rows) in enumerate(shapes):
        state = {n: torch.rand(shape, generator=g) * 0.01 for n in state_names}
        master, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        out.append(OwnedPiece(f"p{i}", f"p{i}", "r", master.numel(), 0, master, grad, state, rows))
    return out


def timed(fn, items, ctx, repeats):
    """Median seconds of ``fn(items, ctx)`` on fresh copies, and the last result."""
    times = []
    for _ in range(repeats):
        work = copy.deepcopy(items)
        start = time.perf_counter()
        fn(work, ctx)
        times.append(time.perf_counter() - start)
    return statistics.median(times), work


def same(a, b) -> bool:
    return all(
        torch.equal(x.master, y.master) and all(torch.equal(x.state[k], y.state[k]) for k in x.state)
        for x, y in zip(a, b)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    h, kv = args.hidden, args.hidden // args.heads
    layer = [((3 * h, h), (kv, kv, kv)), ((h, h), None), ((4 * h, h), None), ((h, 4 * h), None)]
    matrices = pieces(layer * args.layers, ("momentum_buffer",))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(matrices)} matrices of "
        f"{args.layers} layers, hidden {h} (Q/K/V split: {args.heads} groups)"
    )
    for dtype in ("fp32", "bf16"):
        cfg = argparse.Namespace(
            muon_momentum=0.95,
            muon_use_nesterov=True,
            muon_num_ns_steps=5,
            muon_coefficient_type="quintic",
            muon_ns_dtype=dtype,
            muon_ns_algorithm="standard",  # the same kernel both ways (benchmarks/bench_ns_kernels.py compares kernels)
            muon_scale_mode="spectral",
            muon_extra_scale_factor=0.2,
        )
        ctx = StepContext(cfg, 1, lr=0.02, weight_decay=0.1)
        loop_s, looped = timed(muon.step_per_matrix, matrices, ctx, args.repeats)
        batch_s, batched = timed(muon.step_batched, matrices, ctx, args.repeats)
        print(
            f"Muon, NS in {dtype}: per matrix {loop_s * 1e3:8.1f} ms, batched {batch_s * 1e3:8.1f} ms, "
            f"speedup {loop_s / batch_s:.2f}x, bitwise equal: {same(looped, batched)} (not promised)"
        )
    tail = pieces([((n,), None) for n in [h] * (6 * args.layers) + [4 * h] * args.layers], ("exp_avg", "exp_avg_sq"))
    cfg = argparse.Namespace(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    ctx = StepContext(cfg, 3, lr=1e-3, weight_decay=0.1)
    loop_s, looped = timed(adamw.step_per_piece, tail, ctx, args.repeats * 4)
    each_s, foreach = timed(adamw.step, tail, ctx, args.repeats * 4)
    print(
        f"AdamW on {len(tail)} tail pieces: loop {loop_s * 1e3:.2f} ms, foreach {each_s * 1e3:.2f} ms, "
        f"speedup {loop_s / each_s:.2f}x, bitwise equal: {same(looped, foreach)}"
    )


if __name__ == "__main__":
    main()
