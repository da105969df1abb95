"""Training quality of every --optimizer on the embedded corpus: the quick start's model and data
(scripts/quickstart.sh: a 4-layer GPT, hidden 128, on 2 gloo ranks with --use-matrix-fsdp),
300 iterations per run, each optimizer at three learning rates (a factor 3 apart), the rest of
the flags the same (cosine decay, 7% warm-up, weight decay 0.1, --adam-beta2 0.95, clip 1.0).

Printed and written to --out (default benchmarks/results/quality.md): each run's final validation
loss, and per optimizer the best learning rate; one PNG (quality.png) of the best run's curves per
optimizer (training loss, smoothed over 10 iterations, and the validation points).

    .venv/bin/python benchmarks/bench_quality.py                       # 6 optimizers x 3 lr x 300 iterations
    .venv/bin/python benchmarks/bench_quality.py --quick               # CI smoke: 2 optimizers, 1 lr, 6 iterations
    .venv/bin/python benchmarks/bench_quality.py --optimizers soap --flags="--soap-basis current" --out /tmp/q.md
                                                                       # a variant: its rows, flags in the name
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import shlex
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODEL = [
    "--use-matrix-fsdp", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.07",
    "--adam-beta2", "0.95", "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", "1234",
    "--muon-momentum", "0.95", "--muon-use-nesterov", "--muon-extra-scale-factor", "0.2",
    "--muon-coefficient-type", "simple", "--muon-ns-dtype", "fp32", "--log-interval", "10",
    "--distributed-backend", "gloo", "--disable-jit-fuser",
]  # fmt: skip
# Three learning rates per optimizer, a factor 3 apart, centred where each is usually run (Lion
# 3-10x below AdamW; the matrix optimizers' lr also drives the AdamW tail).
SWEEPS = {
    "adam": (1e-3, 3e-3, 1e-2),
    "muon": (1e-3, 3e-3, 1e-2),
    "adaptive_muon": (1e-3, 3e-3, 1e-2),
    "soap": (1e-3, 3e-3, 1e-2),
    "shampoo": (1e-3, 3e-3, 1e-2),
    "lion": (1e-4, 3e-4, 1e-3),
}


def _worker(rank, world_size, argv):
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(parse_args(list(argv), world_size=world_size))


def run(optimizer: str, lr: float, iters: int, eval_interval: int, eval_iters: int, out_dir: str, flags=()) -> dict:
    from megatron_mfsdp.testing import run_workers

    argv = [
        *MODEL, "--optimizer", optimizer, "--lr", str(lr), "--train-iters", str(iters),
        "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters), "--output-dir", out_dir, *flags,
    ]  # fmt: skip
    start = time.perf_counter()
    history = run_workers(2, _worker, argv, threads=1, fresh=True, timeout=3600)[-1]
    return {"history": history, "seconds": time.perf_counter() - start}


def _smooth(points, width: int = 10):
    out = []
    for i in range(len(points)):
        window = [loss for _, loss in points[max(0, i - width + 1) : i + 1]]
        out.append((points[i][0], sum(window) / len(window)))
    return out


def plot(best: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (optimizer, lr), result in best.items():
        line = ax.plot(*zip(*_smooth(result["history"]["train"])), label=f"{optimizer} (lr {lr:g})", linewidth=1.2)
        if result["history"]["valid"]:
            ax.plot(*zip(*result["history"]["valid"]), "o", color=line[0].get_color(), markersize=4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss (train: 10-iteration mean; dots: validation)")
    ax.set_title("Every --optimizer at its best of 3 learning rates, embedded corpus, 4-layer GPT, 2 ranks")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.md"))
    p.add_argument("--quick", action="store_true", help="smoke: adam and soap, their middle lr, 6 iterations")
    p.add_argument(
        "--flags", default="", help="more pretrain flags for every run (a variant, e.g. '--soap-basis current')"
    )
    args = p.parse_args(argv)
    sweeps = {o: SWEEPS[o] for o in args.optimizers}
    flags, variant = shlex.split(args.flags), f" ({args.flags})" if args.flags else ""
    if args.quick:
        sweeps = {o: SWEEPS[o][1:2] for o in ("adam", "soap")}
        args.train_iters, args.eval_interval, args.eval_iters = 6, 3, 1
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer, lrs in sweeps.items():
            for lr in lrs:
                out_dir = f"{tmp}/{optimizer}-{lr}"
                r = run(optimizer, lr, args.train_iters, args.eval_interval, args.eval_iters, out_dir, flags)
                results[(optimizer, lr)] = r
                final = r["history"]["valid"][-1][1]
                seconds = r["seconds"]
                print(
                    f"RUN optimizer={optimizer}{variant} lr={lr:g} final_valid_loss={final:.4f} seconds={seconds:.0f}"
                )
                sys.stdout.flush()
    best = {}
    for optimizer in sweeps:
        lr = min(sweeps[optimizer], key=lambda lr: results[(optimizer, lr)]["history"]["valid"][-1][1])
        best[(optimizer, lr)] = results[(optimizer, lr)]
    lines = [
        f"# Optimizer quality: {args.train_iters} iterations, embedded corpus, quick-start model (2 ranks, MatrixFSDP)",
        "",
        "| optimizer | " + " | ".join(f"lr {i + 1}" for i in range(3)) + " | best lr | final validation loss |",
        "|---|---|---|---|---|---|",
    ]
    for optimizer, lrs in sweeps.items():
        cells = [f"{lr:g}: {results[(optimizer, lr)]['history']['valid'][-1][1]:.4f}" for lr in lrs]
        cells += [""] * (3 - len(cells))
        (b_lr,) = [lr for o, lr in best if o == optimizer]
        lines.append(
            f"| {optimizer}{variant} | "
            + " | ".join(cells)
            + f" | {b_lr:g} | {best[(optimizer, b_lr)]['history']['valid'][-1][1]:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot(best, out.with_suffix(".png"))
    for (optimizer, lr), r in best.items():
        print(f"BEST optimizer={optimizer}{variant} lr={lr:g} final_valid_loss={r['history']['valid'][-1][1]:.4f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
