"""End-to-end training iterations of ours against the paper's baseline and plain data parallelism,
on the same model and data in one run, through pretrain_gpt.py's code path
(``megatron_mfsdp.training.loop.pretrain`` on gloo workers, CPU).

ours   --use-matrix-fsdp (--mfsdp-layout owner): each Muon matrix whole on one DP owner; the
       optimizer step moves no tensor data (one all-reduce of 2 scalars).
even   --use-matrix-fsdp --mfsdp-layout even: the same runtime with ordinary ZeRO-3 even flat
       shards and reconstruction Muon (optim/matrix.py's even variant of Muon: each matrix's
       direction gathered over DP per step, Newton-Schulz on every rank): the paper's baseline.
ddp    pretrain_gpt.py without --use-matrix-fsdp: plain data parallelism. With --optimizer muon
       that is the replicated backend (full weights, gradients and momentum on every rank,
       gradients all-reduced, Muon on every full matrix on every rank); megatron-core 0.16.1's
       DDP itself has no Muon here.

Every mode runs with --overlap-grad-reduce (reductions overlapped with the backward).

Per mode and W it prints the median iteration time (train_step: forward, backward, step; after a
barrier; max over ranks per iteration), the median optimizer step time (max over ranks), the tensor
bytes handed to collectives per iteration in forward+backward and in the step (inputs and outputs
of each call as ``megatron_mfsdp.testing.count_collectives`` records them, rank 0), the step's
tensor collectives (calls with more than 2 elements), the persistent tensor bytes per rank
(parameter and gradient segments, fp32 masters, optimizer state: counted, not RSS; max over ranks)
and the peak: persistent bytes plus the peak of tensor bytes allocated and not yet freed during one
extra, untimed iteration (gathered units, activations, gradients, even's gathered matrices), from
the CPU allocator's events in torch.profiler (profile_memory); max over ranks.

With ``--paper-checkout DIR`` (a checkout of songbingze/matrix-fsdp) it also runs the paper's own
benchmark (test/fsdp/bench_fsdp2_compare.py, owner mode matrix_owner_muon_role_greedy_custom_collective,
--phase-timing, through benchmarks/paper_launcher.py for the NS dtype) on the same shape, per-rank
batch, warm-up and step counts, and prints its step and whole-step times beside ours. Its figures
are means over steps of the slowest rank per phase (its own measurement), ours medians of the
slowest rank; its model is a bare transformer stack with an MSE loss (no embedding or output
layer), ours megatron-core's GPTModel with a --vocab-size embedding; it orthogonalizes the fused QKV
matrix whole (give --muon-no-split-qkv for the same math here). Its whole step includes the
gc.collect() its optimizer's zero_grad makes every step; the line without it is printed too.

    .venv/bin/python benchmarks/bench_end_to_end.py            # W = 2 and 4, 4 layers, hidden 512
    .venv/bin/python benchmarks/bench_end_to_end.py --quick    # CI smoke: tiny model, W = 2
    .venv/bin/python benchmarks/bench_end_to_end.py --modes ours --paper-checkout ../matrix-fsdp --ns-dtype bf16
    .venv/bin/python benchmarks/bench_end_to_end.py --rounds 4 ...   # medians of 4 alternating rounds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time

MODES = {"ours": ["--use-matrix-fsdp"], "even": ["--use-matrix-fsdp", "--mfsdp-layout", "even"], "ddp": []}


def model_flags(a) -> list[str]:
    shape = [
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--ffn-hidden-size", str(4 * a.hidden_size), "--num-attention-heads", str(a.heads),
        "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
        "--vocab-size", str(a.vocab_size),
    ]  # fmt: skip
    return [
        *shape,
        *("--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", str(a.micro_batch_size)),
        *("--train-iters", str(a.iters + 1), "--lr", "1e-3", "--lr-warmup-iters", "0", "--eval-iters", "0"),
        *("--eval-interval", str(10 * a.iters), "--hidden-dropout", "0", "--attention-dropout", "0"),
        *("--optimizer", "muon", "--muon-momentum", "0.95", "--muon-use-nesterov"),
        *("--muon-coefficient-type", "simple", "--muon-ns-dtype", a.ns_dtype, "--log-interval", str(a.iters)),
        *("--muon-ns-algorithm", a.ns_algorithm, "--seed", "1234"),
        # Reductions overlapped with the backward, as Megatron-LM's performance recipes run
        # (examples/llama/train_llama3_8b_h100_fp8.sh at HEAD) and the paper's code does; on a CPU
        # pretrain_gpt.py blocks on each reduction unless this is given (training/setup.py).
        "--overlap-grad-reduce",
        *(["--muon-no-split-qkv"] if a.muon_no_split_qkv else []),
        *shlex.split(a.flags),
    ]  # fmt: skip


@contextlib.contextmanager
def transient_peak():
    """The peak of tensor bytes allocated and not yet freed inside the block (the allocator's
    events as torch.profiler records them with profile_memory): ``peak[0]`` after the block."""
    from torch.profiler import ProfilerActivity, profile

    peak = [0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield peak
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = 0
    for _, nbytes in events:
        live += nbytes
        peak[0] = max(peak[0], live)


def _worker(rank, world, argv):
    """One pretrain run; per iteration its seconds, step seconds and collectives on this rank."""
    import io

    import torch.distributed as dist

    from megatron_mfsdp.testing import count_collectives
    from megatron_mfsdp.training import steps
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    rec = {"iter_s": [], "step_s": [], "calls": [], "step_calls": [], "bytes": {}}
    original = steps.train_step

    def timed(args, run, iteration, num_micro):
        if not hasattr(run.optimizer, "_bench_step"):
            inner = run.optimizer.step

            def counted_step():
                with count_collectives() as calls:
                    out = inner()
                rec["step_calls"].append(list(calls))
                return out

            run.optimizer.step, run.optimizer._bench_step = counted_step, True
        dist.barrier()
        if iteration == args.train_iters:  # the extra last iteration: allocations, not timing
            with transient_peak() as peak:
                out = original(args, run, iteration, num_micro)
            rec["transient_peak"] = peak[0]
            return out
        start = time.perf_counter()
        with count_collectives() as calls:
            out = original(args, run, iteration, num_micro)
        rec["iter_s"].append(time.perf_counter() - start)
        rec["step_s"].append(out[4])
        rec["calls"].append(list(calls))
        rec["bytes"] = {k: v for c in run.chunks for k, v in c.local_bytes().items()}
        rec["bytes"].update(run.optimizer.local_bytes())
        return out

    steps.train_step = timed
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            history = pretrain(parse_args(list(argv), world_size=world))
    finally:
        steps.train_step = original
    rec["losses"] = [loss for _, loss in history["train"]]
    return rec


def _tensor_calls(calls) -> list:
    return [c for c in calls if c[1] > 2]


def summarize(ranks: list[dict], warmup: int) -> dict:
    """Medians over the timed iterations of the max over ranks; bytes of rank 0's calls."""
    n = len(ranks[0]["iter_s"])
    timed = range(min(warmup, n - 1), n)  # the profiled last iteration is not in iter_s
    iter_ms = statistics.median(max(r["iter_s"][i] for r in ranks) * 1e3 for i in timed)
    step_ms = statistics.median(max(r["step_s"][i] for r in ranks) * 1e3 for i in timed)
    last_all, last_step = ranks[0]["calls"][-1], ranks[0]["step_calls"][-1]
    step_bytes = sum(c.nbytes for c in last_step)
    return {
        "iter_ms": iter_ms,
        "step_ms": step_ms,
        "fb_bytes": sum(c.nbytes for c in last_all) - step_bytes,
        "step_bytes": step_bytes,
        "step_tensor_collectives": max(len(_tensor_calls(r["step_calls"][-1])) for r in ranks),
        "persistent_bytes": max(sum(r["bytes"].values()) for r in ranks),
        "peak_bytes": max(sum(r["bytes"].values()) + r["transient_peak"] for r in ranks),
        "losses": ranks[0]["losses"],
    }


def print_world(world: int, rows: dict) -> None:
    print(f"\nW={world}")
    print(
        f"{'mode':>5} {'iter ms':>9} {'step ms':>9} {'fwd+bwd MB':>11} {'step MB':>9} {'step coll':>9} "
        f"{'state MB':>9} {'peak MB':>8}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:>5} {r['iter_ms']:>9.1f} {r['step_ms']:>9.1f} {r['fb_bytes'] / 2**20:>11.2f} "
            f"{r['step_bytes'] / 2**20:>9.2f} {r['step_tensor_collectives']:>9d} {r['persistent_bytes'] / 2**20:>9.2f} "
            f"{r['peak_bytes'] / 2**20:>8.2f}"
        )
    ours = rows["ours"]
    for other in [m for m in ("even", "ddp") if m in rows]:
        r = rows[other]
        print(
            f"{other}/ours: iteration {r['iter_ms'] / ours['iter_ms']:.2f}x, "
            f"step {r['step_ms'] / ours['step_ms']:.2f}x, "
            f"persistent memory {r['persistent_bytes'] / ours['persistent_bytes']:.2f}x, "
            f"peak {r['peak_bytes'] / ours['peak_bytes']:.2f}x, "
            f"max |loss ours - {other}| = {max(abs(a - b) for a, b in zip(ours['losses'], r['losses'])):.3e}"
        )
    counts = " ".join(f"{m}_step_tensor_collectives={r['step_tensor_collectives']}" for m, r in rows.items())
    ratios = " ".join(f"{k}={v:.3f}" for k, v in mode_ratios(rows).items())
    print(f"RESULT W={world} {counts} {ratios}")


def mode_ratios(rows: dict) -> dict[str, float]:
    """Iteration and step time of each baseline over ours (> 1: ours is faster)."""
    ours = rows["ours"]
    out = {}
    for m in [m for m in ("even", "ddp") if m in rows]:
        out[f"iter_{m}_over_ours"] = rows[m]["iter_ms"] / ours["iter_ms"]
        out[f"step_{m}_over_ours"] = rows[m]["step_ms"] / ours["step_ms"]
    return out


def print_medians(world: int, ratios: dict[str, list[float]]) -> None:
    """Each ratio's median over the rounds, with the rounds' values: one run's ratio on a shared
    machine moves by up to 0.3, the median of rounds that alternate the codes much less."""
    rounds = len(next(iter(ratios.values()), []))
    print(f"\nW={world}, medians over {rounds} rounds (each round's value in brackets)")
    for k, v in ratios.items():
        print(f"  {k:>32} {statistics.median(v):.3f}  [{', '.join(f'{x:.3f}' for x in v)}]")
    medians = " ".join(f"{k}={statistics.median(v):.3f}" for k, v in ratios.items())
    print(f"RESULT_MEDIAN W={world} rounds={rounds} {medians}")


PAPER_MODE = "matrix_owner_muon_role_greedy_custom_collective"


def run_paper(a, world: int) -> dict:
    """The paper's owner mode on our shape, by its own benchmark: its phase-timing row (ms)."""
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paper_launcher.py")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [
        *("--device", "cpu", "--model", "transformer", "--unit", "block", "--layers", str(a.num_layers)),
        *("--hidden", str(a.hidden_size), "--intermediate", str(4 * a.hidden_size), "--heads", str(a.heads)),
        *("--seq-len", str(a.seq_length), "--batch-size", str(a.micro_batch_size), "--dtype", "float32"),
        *("--optimizer", "muon", "--warmup-steps", str(a.warmup), "--steps", str(a.iters)),
        *("--world-size", str(world), "--mode", PAPER_MODE, "--phase-timing"),
    ]  # fmt: skip
    env = dict(
        os.environ,
        MFSDP_PAPER_CHECKOUT=os.path.abspath(a.paper_checkout),
        MFSDP_PAPER_NS_DTYPE=a.ns_dtype,
        OMP_NUM_THREADS=str(a.threads),
        PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
    )
    out = subprocess.run([sys.executable, launcher, *argv], env=env, capture_output=True, text=True, timeout=3600)
    lines = out.stdout.splitlines()
    header = next((line.split() for line in lines if line.split()[:1] == ["mode"] and "step_ms" in line), None)
    row = next((line.split() for line in lines if line.startswith(PAPER_MODE)), None)
    if out.returncode or header is None or row is None:
        tail = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        raise SystemExit(f"the paper's benchmark failed (exit {out.returncode}):\n{tail}")
    if len(row) != len(header):  # the 'budget' column is blank in some modes
        raise SystemExit(f"cannot read the paper's phase table row {row} under {header}")
    return {h: float(v) for h, v in zip(header, row) if h.endswith("_ms")}


def paper_ratios(paper: dict, ours: dict) -> dict[str, float]:
    """The paper's step and whole step (with and without its gc.collect) over ours."""
    total, step, zero = paper["total_ms"], paper["step_ms"], paper["zero_ms"]
    return {
        "step_paper_over_ours": step / ours["step_ms"],
        "iter_paper_over_ours": total / ours["iter_ms"],
        "iter_paper_without_gc_over_ours": (total - zero) / ours["iter_ms"],
    }


def print_paper(world: int, paper: dict, ours: dict) -> None:
    total, step, zero = paper["total_ms"], paper["step_ms"], paper["zero_ms"]
    print(
        f"paper owner mode: whole step {total:.1f} ms ({total - zero:.1f} without its zero_grad's gc.collect "
        f"{zero:.1f}), optimizer step {step:.1f} ms"
    )
    print(f"RESULT_PAPER W={world} " + " ".join(f"{k}={v:.3f}" for k, v in paper_ratios(paper, ours).items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, W=2, 2 iterations (CI smoke)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--iters", type=int, default=6, help="timed iterations (one more runs under the memory profiler)")
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    p.add_argument("--ns-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument(
        "--ns-algorithm",
        choices=["auto", "standard", "gram"],
        default="auto",
        help="ours and even (the paper's code runs torch's standard iteration)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--flags", default="", help="more pretrain_gpt.py flags for ours, even and ddp (one string)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="ours is always run")
    p.add_argument("--paper-checkout", default=None, help="a songbingze/matrix-fsdp checkout: run its owner mode too")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every run this often per world size, alternating the codes, and print each ratio's median",
    )
    p.add_argument(
        "--muon-no-split-qkv",
        action="store_true",
        help="orthogonalize the fused QKV matrix whole (the paper's math) instead of Q, K, V apart (Megatron's)",
    )
    a = p.parse_args(argv)
    if a.quick:
        a.num_layers, a.hidden_size, a.heads, a.seq_length, a.vocab_size, a.iters, a.warmup = 2, 64, 4, 32, 256, 2, 1
    a.world_sizes = a.world_sizes or ([2] if a.quick else [2, 4])
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    return a


def main(argv=None) -> None:
    from megatron_mfsdp.testing import run_workers
    from megatron_mfsdp.testing.workers import close_pools

    a = parse_args(argv)
    flags = model_flags(a)
    print(f"bench_end_to_end: {' '.join(flags)}")
    for world in a.world_sizes:
        ratios: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            rows = {}
            for mode, extra in MODES.items():
                if mode != "ours" and mode not in a.modes:
                    continue
                argv = [*flags, *extra, "--global-batch-size", str(a.micro_batch_size * world)]
                ranks = run_workers(world, _worker, argv, threads=a.threads, timeout=3600)
                rows[mode] = summarize(ranks, a.warmup)
            close_pools()  # idle pooled ranks poll (about 5% of a core each): none while the next run is timed
            print_world(world, rows)
            found = mode_ratios(rows)
            if a.paper_checkout:
                paper = run_paper(a, world)
                print_paper(world, paper, rows["ours"])
                found.update(paper_ratios(paper, rows["ours"]))
            for k, v in found.items():
                ratios.setdefault(k, []).append(v)
        if a.rounds > 1 and ratios:
            print_medians(world, ratios)


if __name__ == "__main__":
    main()
