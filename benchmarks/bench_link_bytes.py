"""Critical-path link bytes of a pretrain_gpt.py run: per collective call, the busiest rank's larger
direction (bytes in or out, charged as NCCL's ring algorithms move them), summed over an iteration,
against the mean rank's. An owner fan-out (one rank sending its matrix to every peer, or receiving
every peer's copy) shows here and nowhere in a sum over ranks.

It runs ``megatron_mfsdp.training.loop.pretrain`` (pretrain_gpt.py's code path) on W gloo workers with
the quick start's tiny GPT (4 layers, hidden 128) and --global-batch-size W x 4 (4 micro-batches per
rank), and charges every owner collective of the last iteration. The unit operations come from each
rank's ``SegmentComm.log`` (one record per gather or reduction, charged where the calls are made);
on a checkout whose comm keeps no log it falls back to aligning the ranks' torch.distributed calls
(every rank makes the same sequence there) and charging each one (runtime/call_log.py).

    .venv/bin/python benchmarks/bench_link_bytes.py                       # W = 8, both reduce orders
    .venv/bin/python benchmarks/bench_link_bytes.py --world 4 --orders rank
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = {"forward": "forward gather", "backward": "backward gather", "reduce": "reduction"}


def flags(world: int, micro: int, order: str | None) -> list[str]:
    return [
        *("--use-matrix-fsdp", "--optimizer", "muon", "--num-layers", "4", "--hidden-size", "128"),
        *("--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128"),
        *("--vocab-size", "1024", "--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1"),
        *("--global-batch-size", str(world * micro), "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0"),
        *("--eval-interval", "100", "--log-interval", "1", "--muon-ns-dtype", "fp32"),
        *(["--mfsdp-reduce-order", order] if order else []),
    ]  # fmt: skip


def _worker(rank, world, argv):
    from megatron_mfsdp.testing import count_collectives
    from megatron_mfsdp.training import steps
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import pretrain

    rec, original = {}, steps.train_step

    def charged(args, run, iteration, num_micro):
        logged = [c.comm for c in run.chunks if hasattr(c.comm, "log")]
        for comm in logged:
            comm.log = []
        with count_collectives() as calls:
            out = original(args, run, iteration, num_micro)
        rec["ops"] = [(e.phase, e.op, e.bytes_in, e.bytes_out) for comm in logged for e in comm.log]
        rec["calls"] = [
            (c.name, *c.link)
            for c in calls
            if (c.dtypes and c.dtypes[0].is_floating_point) or c.name == "all_to_all_single"
        ]
        return out

    steps.train_step = charged
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(parse_args(list(argv), world_size=world))
    finally:
        steps.train_step = original
    return rec


def critical_path(ranks: list[dict]) -> dict[str, tuple[int, float]]:
    """Per phase and in all: (sum over operations of the busiest rank's max(in, out), the mean over
    ranks of each rank's sum of max(in, out))."""
    logged = bool(ranks[0]["ops"])
    ops = [r["ops"] if logged else [(None, *c) for c in r["calls"]] for r in ranks]
    assert len({len(o) for o in ops}) == 1, "ranks made different sequences of operations"
    out: dict[str, list] = {}
    for calls in zip(*ops):
        phase = PHASES.get(calls[0][0], "owner collectives") if logged else "torch calls"
        for key in (phase, "iteration"):
            crit, per_rank = out.setdefault(key, [0, [0] * len(ranks)])
            out[key][0] = crit + max(max(c[2], c[3]) for c in calls)
            for r, c in enumerate(calls):
                per_rank[r] += max(c[2], c[3])
    out["iteration"] = out.pop("iteration")  # printed last
    return {k: (crit, sum(per_rank) / len(per_rank)) for k, (crit, per_rank) in out.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per rank")
    parser.add_argument(
        "--orders", nargs="+", default=["rank", "ring"], help="--mfsdp-reduce-order values ('none': omit the flag)"
    )
    a = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from megatron_mfsdp.testing import run_workers

    for order in a.orders:
        ranks = run_workers(a.world, _worker, flags(a.world, a.micro, None if order == "none" else order), fresh=True)
        print(f"\nW={a.world}, {a.micro} micro-batches, reduce order {order}: one iteration, MiB")
        print(f"{'phase':>16} {'critical path':>14} {'mean rank':>10} {'ratio':>6}")
        for phase, (crit, mean) in critical_path(ranks).items():
            print(f"{phase:>16} {crit / 2**20:>14.3f} {mean / 2**20:>10.3f} {crit / mean:>6.3f}")
        crit, mean = critical_path(ranks)["iteration"]
        print(f"RESULT W={a.world} order={order} critical_over_mean={crit / mean:.3f}")


if __name__ == "__main__":
    main()
