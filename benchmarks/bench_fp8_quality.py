"""FP8 parameters against bf16 on the embedded corpus: pretrain_gpt.py's own code path (flags,
set-up, loop) with --use-matrix-fsdp --bf16, a small Muon GPT, the same seed and data.

Runs: bf16; --fp8-param-gather with --fp8-recipe tensorwise and blockwise (fp32 masters, the
owner quantizes after every step); and the negative control "fp8-only": tensorwise with the
fp32 master of every FP8 matrix replaced by its dequantized FP8 weight after each step
(``megatron_mfsdp.testing.fp8.drop_fp8_masters``), i.e. the weight stored in FP8 alone.

Printed per run: the mean lm loss of the last 20 iterations, its relative delta to bf16, and
the drift: ||W - W_bf16||_F / ||W_bf16||_F over the transformer matrices at the end (what
each run computes with). The FP8 runs should stay within 2% of bf16's loss and the negative
control should drift visibly more than the runs with a master.

    .venv/bin/python benchmarks/bench_fp8_quality.py [--train-iters 150] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile

MODEL = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--optimizer", "muon", "--muon-momentum", "0.95",
    "--muon-use-nesterov", "--muon-extra-scale-factor", "0.2", "--muon-ns-dtype", "fp32", "--clip-grad", "1.0",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--num-workers", "0",
    "--eval-iters", "1", "--eval-interval", "1000", "--disable-jit-fuser", "--distributed-backend", "gloo",
    "--use-matrix-fsdp", "--bf16",
]  # fmt: skip
RUNS = {
    "bf16": [],
    "fp8 tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
    "fp8 blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-param-gather"],
    "fp8-only (no fp32 master)": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
}


def _worker(rank, world_size, argv, drop_masters):
    """pretrain() in a gloo worker; returns the loss history and the final weights."""
    from megatron_mfsdp.optim.optimizer import MatrixFSDPOptimizer
    from megatron_mfsdp.testing.fp8 import drop_fp8_masters
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    seen, step = [], MatrixFSDPOptimizer.step

    def patched(self):
        seen[:] = [self]
        result = step(self)
        if drop_masters:
            drop_fp8_masters(self)
        return result

    MatrixFSDPOptimizer.step = patched
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            history = pretrain(parse_args(list(argv), world_size=world_size))
    finally:
        MatrixFSDPOptimizer.step = step
    weights = seen[0].model_chunks[0].full_state_dict()
    return {"losses": [loss for _, loss in history["train"]], "weights": weights}


def _drift(weights, reference) -> float:
    names = [n for n, w in reference.items() if w.dim() == 2 and ".layers." in n]
    num = sum(float((weights[n].float() - reference[n].float()).norm() ** 2) for n in names)
    return (num / sum(float(reference[n].float().norm() ** 2) for n in names)) ** 0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=150)
    p.add_argument("--quick", action="store_true", help="30 iterations (a smoke run)")
    args = p.parse_args()
    iters = 30 if args.quick else args.train_iters
    window = min(20, iters // 3)

    from megatron_mfsdp.testing import run_workers

    results = {}
    with tempfile.TemporaryDirectory() as out:
        for label, flags in RUNS.items():
            argv = MODEL + ["--train-iters", str(iters), "--log-interval", str(iters), *flags, "--output-dir", out]
            results[label] = run_workers(1, _worker, argv, label.startswith("fp8-only"), fresh=True)[0]
    base = sum(results["bf16"]["losses"][-window:]) / window
    print(f"embedded corpus, {iters} iterations, mean lm loss of the last {window}:")
    for label, r in results.items():
        final = sum(r["losses"][-window:]) / window
        drift = _drift(r["weights"], results["bf16"]["weights"])
        print(
            f"RESULT {label:28s} loss {final:.4f}  delta vs bf16 {final - base:+.4f} ({(final - base) / base:+.2%})"
            f"  weight drift vs bf16 {drift:.4f}"
        )


if __name__ == "__main__":
    main()
