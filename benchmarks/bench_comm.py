"""Owner-segment communication in both reduction orders, with and without overlap, side by side.

For each data-parallel size W (gloo, CPU) one megatron-core GPT is wrapped four times by
MatrixFSDP with the same weights and data. Every gather is a broadcast per owner part plus an
all-gather of the padded tail (runtime/comm.py); the reduction is

rank          the chain in rank order (runtime/chain.py), bitwise the single-process sum: gloo's default;
ring          a reduce per owner part and a reduce-scatter of the tail, in the ring's order: NCCL's default;

each waited for inside the grad hook, or ``+overlap``: started asynchronously and waited for at most
``max_reduces_in_flight`` later (or at finish_grad_sync).

Per variant it prints the owner collectives per unit and micro-batch (counted with
megatron_mfsdp.testing.count_collectives), the busiest rank's link bytes per unit operation (each
call charged as NCCL's rings move it, runtime/call_log.py), the median forward-backward iteration time
(maximum over ranks, timed iterations interleaved across variants), and the ratio to ``rank``; then,
for a tied and an untied model, the critical path per phase against ZeRO-3's bytes per rank. The
rank-order variants' reduced gradients are compared bitwise, ring's within rounding.

    .venv/bin/python benchmarks/bench_comm.py              # W = 2 and 4, 4 layers, hidden 256
    .venv/bin/python benchmarks/bench_comm.py --quick      # smoke, tiny model, W = 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_mfsdp.testing import count_collectives, init_megatron, run_workers, tiny_gpt

VARIANTS = {
    "rank": dict(reduce_order="rank", overlap_grad_reduce=False),
    "ring": dict(reduce_order="ring", overlap_grad_reduce=False),
    "rank+overlap": dict(reduce_order="rank", overlap_grad_reduce=True),
    "ring+overlap": dict(reduce_order="ring", overlap_grad_reduce=True),
}
OWNER_OPS = ("broadcast", "all_gather_single", "reduce", "reduce_scatter_single", "isend", "irecv")


def _model(a, tied=True):
    return tiny_gpt(
        tied=tied,
        seq_length=a.seq,
        num_layers=a.layers,
        hidden_size=a.hidden,
        ffn_hidden_size=4 * a.hidden,
        num_attention_heads=8,
        num_query_groups=8,
    )


def _iteration(ddp, a, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    for _ in range(a.micro):
        tokens = torch.randint(0, 96, (a.mbs, a.seq), generator=g)
        positions = torch.arange(a.seq).expand_as(tokens)
        (ddp(tokens, positions, None, labels=tokens).float().mean() / a.micro).backward()
    ddp.finish_grad_sync()


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _counts(ddp, a, rank) -> dict:
    ddp.zero_grad_buffer()
    ddp.comm.log = []
    with count_collectives() as calls:
        _iteration(ddp, a, rank, 0)
    ops = [c for c in calls if c.name in OWNER_OPS and c.dtypes[0] != torch.int64]  # not the signatures
    links = torch.tensor([max(e.bytes_in, e.bytes_out) for e in ddp.comm.log], dtype=torch.float64)
    dist.all_reduce(links, op=dist.ReduceOp.MAX)  # the same unit operations on every rank: the busiest
    ddp.comm.log = None
    per = len(ddp.units) * a.micro
    return {
        "calls_per_unit": len(ops) / per,
        "busiest_bytes_per_op": links.mean().item(),
        "grads": ddp.gathered("grad"),
    }


def _worker(rank, world_size, a):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    init_megatron()
    wrapped = {}
    for name, overrides in VARIANTS.items():
        config, model = _model(a)
        wrapped[name] = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False, **overrides), model)
    out = {name: _counts(ddp, a, rank) for name, ddp in wrapped.items()}
    times = {name: [] for name in wrapped}
    for step in range(a.warmup + a.iters):
        for name, ddp in wrapped.items():
            ddp.zero_grad_buffer()
            dist.barrier()
            start = time.perf_counter()
            _iteration(ddp, a, rank, step + 1)
            elapsed = _max_over_ranks(time.perf_counter() - start)
            if step >= a.warmup:
                times[name].append(elapsed)
    for name in wrapped:
        out[name]["iter_ms"] = 1000 * statistics.median(times[name])
    out["traffic"] = {tied: _traffic(a, rank, tied) for tied in (True, False)}
    return out


def _traffic(a, rank, tied: bool) -> dict:
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig

    config, model = _model(a, tied)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(verify_collectives=False), model)
    _iteration(ddp, a, rank, 0)
    return ddp.traffic_per_iteration(a.micro)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, W=2, 2 iterations")
    a = p.parse_args()
    if a.quick:
        a.world_sizes, a.layers, a.hidden, a.seq, a.iters = [2], 2, 64, 32, 2
    print(f"GPT {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.mbs} x {a.micro}, fp32, gloo")
    for w in a.world_sizes:
        r = run_workers(w, _worker, a, threads=a.threads, fresh=True, timeout=3600)[0]
        base = r["rank"]
        for name in VARIANTS:
            v = r[name]
            same = all(torch.equal(x, y) for x, y in zip(v["grads"], base["grads"]))
            close = all(torch.allclose(x, y, rtol=1e-5, atol=1e-8) for x, y in zip(v["grads"], base["grads"]))
            print(
                f"RESULT W={w} variant={name} calls_per_unit={v['calls_per_unit']:.2f} "
                f"busiest_bytes_per_op={v['busiest_bytes_per_op']:.0f} iter_ms={v['iter_ms']:.1f} "
                f"speedup_vs_rank={base['iter_ms'] / v['iter_ms']:.2f} grads_bitwise_equal_rank={same} "
                f"grads_within_1e-5_of_rank={close}"
            )
        for tied, phases in r["traffic"].items():
            text = ", ".join(f"{ph} {m / 2**20:.3f} MiB ({m / z:.2f} x ZeRO-3)" for ph, (m, z) in phases.items())
            print(f"TRAFFIC W={w} tied={tied} (critical path: the busiest rank of each call): {text}")


if __name__ == "__main__":
    main()
