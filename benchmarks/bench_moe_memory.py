"""Persistent bytes per rank of an MoE GPT at EP 2, counted tensor by tensor on gloo ranks, side by side
(issue 28):

  matrixfsdp   owners (this project): dense matrices whole on DP owners, experts whole on expert-DP
               owners (the expert domain), --optimizer muon; every rank's parameter and gradient
               segments, fp32 masters and optimizer state
  megatron     megatron-core's DDP + DistributedOptimizer at the same EP (--optimizer adam
               --use-distributed-optimizer): its parameter and gradient buffers (every rank holds its EP
               slice whole), fp32 main-parameter shards and Adam state shards
  layerwise    the full replica Megatron-LM HEAD's LayerWiseDistributedOptimizer keeps: megatron's whole
               parameters and gradients of the EP slice, plus ours' masters and state for owned matrices

Each model is built by pretrain_gpt.py's own set-up (parse_args, initialize_distributed,
build_model_and_optimizer); megatron's Adam state is allocated as its first step would
(DistributedOptimizer._init_optimizer_states_with_dummy_values). Printed per rank and the busiest
rank's ratios.

    .venv/bin/python benchmarks/bench_moe_memory.py              # 4 ranks, EP 2, 8 experts, bf16
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
    "--num-experts", "8", "--moe-ffn-hidden-size", "256", "--moe-router-topk", "2", "--swiglu",
    "--disable-bias-linear", "--bf16", "--distributed-backend", "gloo", "--disable-jit-fuser",
]  # fmt: skip


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _megatron_bytes(chunks, optimizer) -> dict:
    """megatron-core DDP's buffers (parameters live in them under the distributed optimizer) and its
    optimizer's fp32 shards and state."""
    buffers = [b for c in chunks for b in (*c.buffers, *c.expert_parallel_buffers)]
    params = _bytes(b.param_data for b in buffers if b.param_data is not None)
    if not params:
        params = _bytes(p for c in chunks for p in c.module.parameters())
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    masters = _bytes(
        p for o in inner for group in getattr(o, "shard_fp32_from_float16_groups", []) for p in group
    )  # fmt: skip
    state = _bytes(t for o in inner for st in o.optimizer.state.values() for t in st.values() if hasattr(t, "numel"))
    grads = _bytes(b.grad_data for b in buffers)
    return {"params": params, "grads": grads, "masters": masters, "optimizer_state": state}


def _worker(rank, world_size, argv):
    from megatron_mfsdp.compat.cpu import cuda_on_cpu
    from megatron_mfsdp.data.datasets import padded_vocab_size
    from megatron_mfsdp.training.arguments import parse_args
    from megatron_mfsdp.training.loop import build_run_tokenizer, initialize_distributed
    from megatron_mfsdp.training.setup import MEGATRON_DDP, backend, build_model_and_optimizer

    with contextlib.redirect_stdout(io.StringIO()):
        args = parse_args(list(argv), world_size=world_size)
        initialize_distributed(args)
        vocab = padded_vocab_size(build_run_tokenizer(args).vocab_size, args.make_vocab_size_divisible_by, 1)
        _, _, chunks, optimizer, _ = build_model_and_optimizer(args, vocab)
    if backend(args) == MEGATRON_DDP:
        with cuda_on_cpu():
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                if not inner.optimizer.state:
                    inner._init_optimizer_states_with_dummy_values()
        return _megatron_bytes(chunks, optimizer)
    out = {**chunks[0].local_bytes(), **optimizer.local_bytes()}
    out["expert_units"] = len(chunks[0].domains.get("expert", type("", (), {"units": []})).units)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--ep", type=int, default=2)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron_mfsdp.testing import run_workers

    ep = ["--expert-model-parallel-size", str(args.ep)]
    ours = run_workers(args.world_size, _worker, [*MODEL, *ep, "--use-matrix-fsdp", "--optimizer", "muon"])
    theirs = run_workers(
        args.world_size, _worker, [*MODEL, *ep, "--optimizer", "adam", "--use-distributed-optimizer"]
    )  # fmt: skip
    print(f"MoE GPT, 4 layers of 8 experts (hidden 128, expert FFN 256), bf16, W={args.world_size} EP={args.ep}")
    print(
        f"{'rank':>4} {'matrixfsdp MiB':>15} {'megatron MiB':>13} {'layerwise MiB':>14}   params/grads/masters/state "
        "MiB: ours (Muon), megatron's (Adam)"
    )
    totals = []
    for rank, (o, m) in enumerate(zip(ours, theirs)):
        mine = o["params"] + o["grads"] + o["masters"] + o["optimizer_state"]
        megatron = m["params"] + m["grads"] + m["masters"] + m["optimizer_state"]
        layerwise = m["params"] + m["grads"] + o["masters"] + o["optimizer_state"]
        totals.append((mine, megatron, layerwise))
        parts = ", ".join(
            "/".join(f"{r[k] / 2**20:.2f}" for k in ("params", "grads", "masters", "optimizer_state")) for r in (o, m)
        )
        print(f"{rank:>4} {mine / 2**20:>15.2f} {megatron / 2**20:>13.2f} {layerwise / 2**20:>14.2f}   {parts}")
    busiest = [max(t[i] for t in totals) for i in range(3)]
    print(
        f"BUSIEST matrixfsdp={busiest[0]} megatron={busiest[1]} layerwise={busiest[2]} "
        f"matrixfsdp_over_megatron={busiest[0] / busiest[1]:.3f} "
        f"layerwise_over_matrixfsdp={busiest[2] / busiest[0]:.3f}"
    )


if __name__ == "__main__":
    main()
