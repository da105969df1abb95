"""Owner-planner quality against lower bounds, old (constructive only) against new
(constructive + local search), over data-parallel sizes, for GPT and Llama shapes.

Per row: the policy 'auto' chose, NS-flops and bytes max/mean over DP ranks (1.000 is
perfect) as old -> new, and the lower bound no plan can beat (bounds.py); a new figure
at its bound is optimal. Shapes are megatron-core's TP-local ones, from the flags
(tools/plan.py, checked against meta-built GPTModels in tests/unit/test_planner_search.py).
The bound is bounds.py's max_load_bound: max(largest item, total / W, a_W + a_(W+1), and the
same pigeonhole for k + 1 items on a rank), per kind (NS cost, elements).

    .venv/bin/python benchmarks/bench_planner.py
    .venv/bin/python benchmarks/bench_planner.py --split-qkv-owners all

Matrices are costed as the planner costs them at start-up: the multiply-adds of the Newton-Schulz
run the flags give (5 steps in bf16, standard iteration, unless --ns-flags says otherwise, e.g.
"--muon-ns-dtype fp32" for the Gram-space kernel where it pays). --cost leading-term re-costs them
by m*n*min(m, n) per block, the leading term the planner used before (issue 11's figures).

--split-qkv-owners plans the Q, K and V blocks of each linear_qkv as items of their own
(placement/blocks.py), as --mfsdp-split-qkv-owners places them in training: contiguous where a
TP shard holds one query group, all also where groups interleave them.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LLAMA = (
    "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --vocab-size 128256"
)
CASES = {
    "gpt-24x2048": (
        "--num-layers 24 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16 "
        "--vocab-size 50304 --seq-length 2048 --max-position-embeddings 2048",
        (8, 16, 32, 64, 128),
    ),
    "llama3-8b-tp1": (
        f"--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 {_LLAMA}",
        (8, 16, 32, 64),
    ),
    "llama3-8b-tp2": (
        f"--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 {_LLAMA} "
        "--tensor-model-parallel-size 2",
        (8, 16, 32, 64),
    ),
    "llama3-70b-tp8": (
        f"--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 {_LLAMA} "
        "--tensor-model-parallel-size 8",
        (8, 16, 32, 64, 128, 256),
    ),
}
"""Each case: Megatron-LM flags of the model (as pretrain_gpt.py takes them), DP sizes."""


def plan_tool():
    """tools/plan.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("mfsdp_plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_specs(flags: str):
    """(validated flags, planner specs) of a case."""
    tool = plan_tool()
    args = tool.parse(flags.split() + ["--data-parallel-size", "1"])
    return args, tool.specs_from_args(args)


def leading_term(specs):
    """Specs with every matrix re-costed by m*n*min(m, n) per block orthogonalized apart: the
    leading term of one iteration, the planner's cost before it took the optimizer's run."""
    import dataclasses

    from megatron_mfsdp.optim.newton_schulz import orthogonalized_blocks
    from megatron_mfsdp.placement import WHOLE, UnitSpec

    def cost(p):
        return sum(r * c * min(r, c) for r, c in orthogonalized_blocks(p.shape, p.split_rows))

    return [
        UnitSpec(u.name, [dataclasses.replace(p, cost=cost(p)) if p.storage == WHOLE else p for p in u.params])
        for u in specs
    ]


def split_qkv_owners(specs, mode: str, ns=None):
    """Specs with Q, K and V planned apart where ``mode`` allows (placement/blocks.py), each block
    costed by the Newton-Schulz run ``ns`` (muon.NewtonSchulzCost; the default run if None)."""
    from megatron_mfsdp.config import muon_rule_set
    from megatron_mfsdp.optim.newton_schulz import NewtonSchulzCost
    from megatron_mfsdp.placement.blocks import split_qkv_blocks

    rules = muon_rule_set(ns or NewtonSchulzCost())
    return split_qkv_blocks(specs, mode, rules.cost, rules.state_bytes)


def old_auto(specs, world_size: int):
    """The planner before local search: the better constructive plan by worst max/mean."""
    from megatron_mfsdp.placement import balance, plan_units

    plans = [plan_units(specs, world_size, policy) for policy in ("greedy", "global")]
    return min(plans, key=lambda plan: max(balance(v) for v in plan.per_rank_load()))


def row(specs, world_size: int) -> str:
    from megatron_mfsdp.placement import balance, plan_units
    from megatron_mfsdp.placement.bounds import plan_bounds

    start = time.perf_counter()
    new = plan_units(specs, world_size, "auto")
    seconds = time.perf_counter() - start
    (old_elements, old_costs), (elements, costs) = old_auto(specs, world_size).per_rank_load(), new.per_rank_load()
    bounds = plan_bounds(specs, world_size)
    return (
        f"{world_size:>5} {new.policy:>14} "
        f"{balance(old_costs):>7.3f} -> {balance(costs):.3f} {bounds.ns_flops:>7.3f}   "
        f"{balance(old_elements):>7.3f} -> {balance(elements):.3f} {bounds.bytes:>7.3f} {seconds * 1e3:>8.0f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument(
        "--split-qkv-owners",
        choices=["whole", "contiguous", "all"],
        default="whole",
        help="plan Q, K and V blocks as separate matrices ('contiguous': only where a TP shard holds one "
        "query group; 'all': everywhere), as --mfsdp-split-qkv-owners trains them",
    )
    p.add_argument("--ns-flags", default="", help="Newton-Schulz flags for every case, e.g. '--muon-ns-dtype fp32'")
    p.add_argument(
        "--cost",
        choices=["optimizer", "leading-term"],
        default="optimizer",
        help="optimizer: multiply-adds of the Newton-Schulz run (the planner's cost); leading-term: m*n*min(m,n)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timing of the largest case: best of N")
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    header = (
        f"{'W':>5} {'policy':>14} {'NS old -> new':>16} {'bound':>7}   {'bytes old -> new':>16} {'bound':>7} {'ms':>8}"
    )
    from megatron_mfsdp.optim.newton_schulz import NewtonSchulzCost

    largest = None
    for name in args.cases:
        flags, world_sizes = CASES[name]
        case_args, specs = case_specs(f"{flags} {args.ns_flags}")
        if args.split_qkv_owners != "whole":
            specs = split_qkv_owners(
                specs,
                args.split_qkv_owners,
                NewtonSchulzCost(case_args.muon_num_ns_steps, case_args.muon_ns_dtype, case_args.muon_ns_algorithm),
            )
        if args.cost == "leading-term":
            specs = leading_term(specs)
        print(
            f"\n{name}: {flags} {args.ns_flags}".rstrip()
            + (" [cost: leading term]" if args.cost == "leading-term" else "")
            + (f" [Q/K/V owners: {args.split_qkv_owners}]" if args.split_qkv_owners != "whole" else "")
        )
        print(header)
        for w in world_sizes:
            print(row(specs, w))
        if largest is None or len(specs) * max(world_sizes) > largest[0]:
            largest = (len(specs) * max(world_sizes), name, specs, max(world_sizes))
    _, name, specs, w = largest
    from megatron_mfsdp.placement import plan_units

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan_units(specs, w, "auto")
        times.append(time.perf_counter() - start)
    print(f"\nplanner run time, {name} at W={w}: {min(times):.3f} s (best of {args.repeats})")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
