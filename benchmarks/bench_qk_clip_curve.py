"""A Kimi-K2-style run with and without QK-clip, side by side: the loss and the max attention logit per
step, at a learning rate where the unclipped run's max logit grows; a PNG of both.

The model is scaled down from Kimi K2's recipe (arXiv 2507.20534): MoE layers with a shared expert,
sigmoid routing with the aux-loss-free expert bias, a dense first layer (--moe-layer-freq), Muon on
every matrix, --use-matrix-fsdp with EP 2 on 4 gloo ranks (torchrun, pretrain_gpt.py, the embedded
default data). ``--attention mla`` uses multi-latent attention where megatron-mfsdp has it. Each run
is pretrain_gpt.py as a user runs it; the figures come from its iteration lines.

    .venv/bin/python benchmarks/bench_qk_clip_curve.py --out benchmarks/results/qk_clip_curve.png
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"iteration\s+(\d+)/.*? lm loss: ([\d.E+-]+) \|.*? max_attention_logit: ([\d.E+-]+) \|")
MODEL = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
    "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 "
    "--moe-layer-freq [0,1,1,1] --moe-aux-loss-coeff 1e-4 --expert-model-parallel-size 2 --use-matrix-fsdp "
    "--micro-batch-size 4 --global-batch-size 16 --hidden-dropout 0 --attention-dropout 0 "
    "--optimizer muon --muon-momentum 0.95 --weight-decay 0.1 --lr-warmup-iters 5 --lr-decay-style constant "
    "--log-interval 1 --eval-iters 0 --log-max-attention-logit --seed 11"
)
MLA = (
    "--multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 "
    "--v-head-dim 32"
)


def run(flags: list[str], nproc: int, folder: str) -> list[tuple[int, float, float]]:
    """pretrain_gpt.py under torchrun; (iteration, lm loss, max logit) of every iteration line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "pretrain_gpt.py"]
    cmd += [*flags, "--output-dir", folder]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"pretrain_gpt.py failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return [(int(i), float(loss), float(m)) for i, loss, m in LINE.findall(out.stdout)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.05, help="high enough that the unclipped max logit grows")
    p.add_argument("--threshold", type=float, default=20.0, help="--qk-clip-threshold of the clipped run")
    p.add_argument("--attention", choices=("mha", "mla"), default="mha")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--out", default=None, help="a PNG of both runs' loss and max logit per step")
    args = p.parse_args(argv)
    base = MODEL.split() + ["--train-iters", str(args.iters), "--lr", str(args.lr), "--min-lr", str(args.lr)]
    base += MLA.split() if args.attention == "mla" else []
    with tempfile.TemporaryDirectory() as tmp:
        free = run(base, args.nproc, os.path.join(tmp, "free"))
        clipped = run(base + ["--qk-clip", "--qk-clip-threshold", str(args.threshold)], args.nproc, tmp + "/clip")
    for label, rows in (("without QK-clip", free), (f"QK-clip at {args.threshold:g}", clipped)):
        peak = max(m for _, _, m in rows)
        print(
            f"{label}: lm loss {rows[0][1]:.3f} -> {rows[-1][1]:.3f}, max logit {rows[0][2]:.2f} -> "
            f"{rows[-1][2]:.2f} (peak {peak:.2f})"
        )
    print(
        f"RESULT attention={args.attention} lr={args.lr:g} threshold={args.threshold:g} "
        f"free_final_loss={free[-1][1]:.4f} clip_final_loss={clipped[-1][1]:.4f} "
        f"free_peak_logit={max(m for _, _, m in free):.3f} clip_peak_logit={max(m for _, _, m in clipped):.3f}"
    )
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
        for label, rows in (("without QK-clip", free), (f"--qk-clip-threshold {args.threshold:g}", clipped)):
            steps = [i for i, _, _ in rows]
            top.plot(steps, [m for _, _, m in rows], label=label)
            bottom.plot(steps, [loss for _, loss, _ in rows], label=label)
        top.axhline(args.threshold, color="grey", linestyle=":", linewidth=1)
        top.set_yscale("log")
        top.set_ylabel("max attention logit (log scale)")
        bottom.set_ylabel("lm loss")
        bottom.set_xlabel("iteration")
        top.legend()
        top.set_title(f"Kimi-K2-style MoE ({args.attention.upper()}), Muon lr {args.lr:g}, EP 2 on {args.nproc} ranks")
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
