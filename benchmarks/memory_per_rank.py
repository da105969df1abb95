"""Persistent bytes per rank against the data-parallel size W, from the plan of a
megatron GPT (built on the meta device: no memory, no processes).

Per element a rank keeps: the bf16 parameter (2 B), the fp32 gradient
accumulator (4 B), the fp32 master (4 B) and the optimizer state (Muon momentum
4 B on matrices, AdamW moments 8 B on the tail). Compared side by side:

  matrixfsdp  owner segments (this project): whole matrices on owners + even tail
  zero3       even flat shards of everything (the same bytes, spread evenly)
  zero1-owner megatron's LayerWiseDistributedOptimizer layout: every rank keeps full
              bf16 weights and gradients; masters and state only for owned matrices

    .venv/bin/python benchmarks/memory_per_rank.py --world-sizes 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--ffn-hidden-size", type=int, default=8192)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--planner", default="auto")
    args = p.parse_args()

    import torch.distributed as dist

    from megatron_mfsdp.testing import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    from megatron_mfsdp import MatrixFSDPConfig
    from megatron_mfsdp.models.gpt import GPT_ADAPTER, build_gpt_model
    from megatron_mfsdp.placement import WHOLE, plan_units
    from megatron_mfsdp.placement.specs import unit_specs
    from megatron_mfsdp.testing import tiny_gpt_config

    parallel_state.initialize_model_parallel(1, 1)
    cfg = tiny_gpt_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_attention_heads,
        perform_initialization=False,
    )
    with torch.device("meta"):
        model = build_gpt_model(cfg, vocab_size=args.vocab_size, max_sequence_length=2048)
    specs = unit_specs(GPT_ADAPTER.units(model), MatrixFSDPConfig(), GPT_ADAPTER, cfg)
    total_matrix = sum(q.numel for u in specs for q in u.params if q.storage == WHOLE)
    total_tail = sum(q.numel for u in specs for q in u.params if q.storage != WHOLE)
    total = total_matrix + total_tail
    print(
        f"GPT {args.num_layers} layers, hidden {args.hidden_size}: {total / 1e9:.3f} B parameters "
        f"({total_matrix / total:.1%} in Muon matrices)"
    )
    print(f"{'W':>4} {'matrixfsdp max GiB':>19} {'zero3 GiB':>10} {'ratio':>6} {'zero1-owner GiB':>16}")
    gib = 1024**3
    for w in args.world_sizes:
        plan = plan_units(specs, w, args.planner)
        worst = 0
        for r in range(w):
            matrix = tail = 0
            for unit in plan.units:
                for piece in unit.local_pieces(r):
                    if piece.slot.storage == WHOLE:
                        matrix += piece.numel
                    else:
                        tail += piece.numel
            worst = max(worst, matrix * (2 + 4 + 4 + 4) + tail * (2 + 4 + 4 + 8))
        zero3 = (total_matrix * 14 + total_tail * 18) / w
        zero1 = total * (2 + 2) + (total_matrix * 8 + total_tail * 12) / w
        print(f"{w:>4} {worst / gib:>19.3f} {zero3 / gib:>10.3f} {worst / zero3:>6.3f} {zero1 / gib:>16.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
