#!/usr/bin/env python
"""Print the MatrixFSDP owner plan of a GPT shape at a data-parallel size, without launching anything.

It takes pretrain_gpt.py's own flags (the same parser, types and model checks, so a training
command line can be pasted as it is) plus --data-parallel-size, e.g. Llama-3-70B at TP 8 over
32 DP ranks::

    python tools/plan.py --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \
        --num-attention-heads 64 --group-query-attention --num-query-groups 8 --swiglu \
        --normalization RMSNorm --disable-bias-linear --position-embedding-type rope \
        --untie-embeddings-and-output-weights --vocab-size 128256 \
        --tensor-model-parallel-size 8 --data-parallel-size 32 --bf16

It prints the plan table training prints at start-up (owned bytes and Newton-Schulz flops per
DP rank, the max/mean line) and the lower bounds on max/mean that no owner assignment can
beat; at --expert-model-parallel-size above 1 the expert domain's plan follows (the experts
planned over expert DP = world / (EP x expert TP), as the runtime shards them). With --traffic
it also drives units of the plan through every DP rank's own SegmentComm in this one process
(torch's fake process-group backend, shapes only: megatron_mfsdp/runtime/at_scale.py) and
prints per unit the calls of a gather and a reduction, the busiest rank's bytes against
ZeRO-3's bytes per rank, and the largest buffer; then the same table for the expert domain's
units over the expert-DP ranks (its RESULT line tagged domain=expert).
Owners are planned over DP / --mfsdp-replicate-size ranks, as at start-up. Parameter shapes are
megatron-core's TP-local ones (local layer spec, one pipeline stage), computed from the flags
rather than built, so any TP size plans in one process; tests/unit/test_planner_search.py checks
them against GPTModels built on the meta device.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Shapes = list[tuple[str, tuple[int, ...]]]


def _norm(prefix: str, size: int, layernorm: bool) -> Shapes:
    return [(f"{prefix}.weight", (size,))] + ([(f"{prefix}.bias", (size,))] if layernorm else [])


def _linear(prefix: str, rows: int, cols: int, bias: int | None) -> Shapes:
    """A linear layer's weight (rows, cols) and, when ``bias`` is a size, its bias."""
    return [(f"{prefix}.weight", (rows, cols))] + ([(f"{prefix}.bias", (bias,))] if bias else [])


def layer_shapes(args, index: int) -> Shapes:
    """One transformer layer's parameters in megatron-core's registration order (local spec):
    linear_qkv and linear_fc1 are column parallel (rows / TP, bias split), linear_proj and
    linear_fc2 row parallel (columns / TP, bias whole). QKV rows are (heads + 2 * groups) *
    kv_channels, fc1 rows twice the FFN size with SwiGLU (matches megatron/core/transformer/
    attention.py and mlp.py at core_v0.16.1)."""
    from megatron_mfsdp.training.logging import moe_layer_pattern

    h, tp, kv = args.hidden_size, args.tensor_model_parallel_size, args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    qkv_rows = (args.num_attention_heads + 2 * groups) * kv // tp
    fc1_rows = (2 if args.swiglu else 1) * args.ffn_hidden_size // tp
    layernorm, bias = args.normalization == "LayerNorm", args.add_bias_linear
    p = f"decoder.layers.{index}"
    mlp = (
        moe_shapes(args, f"{p}.mlp")
        if moe_layer_pattern(args)[index]
        else _linear(f"{p}.mlp.linear_fc1", fc1_rows, h, fc1_rows if bias else None)
        + _linear(f"{p}.mlp.linear_fc2", h, args.ffn_hidden_size // tp, h if bias else None)
    )
    if args.multi_latent_attention:  # MLASelfAttention's projections and latent norms (models/gpt/mla.py)
        from megatron_mfsdp.models.gpt.mla import attention_shapes

        attention = [(f"{p}.self_attention.{name}", shape) for name, shape in attention_shapes(vars(args), tp)]
        return (
            _norm(f"{p}.input_layernorm", h, layernorm)
            + attention
            + _norm(f"{p}.pre_mlp_layernorm", h, layernorm)
            + mlp
        )
    attention = _linear(f"{p}.self_attention.linear_proj", h, args.num_attention_heads * kv // tp, h if bias else None)
    attention += _linear(f"{p}.self_attention.linear_qkv", qkv_rows, h, qkv_rows if bias or args.add_qkv_bias else None)
    if args.qk_layernorm:
        attention += _norm(f"{p}.self_attention.q_layernorm", kv, layernorm)
        attention += _norm(f"{p}.self_attention.k_layernorm", kv, layernorm)
    return _norm(f"{p}.input_layernorm", h, layernorm) + attention + _norm(f"{p}.pre_mlp_layernorm", h, layernorm) + mlp


def moe_shapes(args, p: str) -> Shapes:
    """An MoE layer's parameters in megatron-core's registration order (moe_layer.py: router, experts,
    shared experts): the router's weight (experts, hidden; its expert bias is a buffer), each local
    expert's linear_fc1/fc2 (SequentialMLP, split over expert TP) and the shared experts' (over TP)."""
    h, tp = args.hidden_size, args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp  # Megatron-LM's default: the dense TP
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    glu = 2 if args.swiglu else 1
    out, bias = [(f"{p}.router.weight", (args.num_experts, h))], args.add_bias_linear
    for j in range(args.num_experts // args.expert_model_parallel_size):
        e = f"{p}.experts.local_experts.{j}"
        out += _linear(f"{e}.linear_fc1", glu * ffn // etp, h, glu * ffn // etp if bias else None)
        out += _linear(f"{e}.linear_fc2", h, ffn // etp, h if bias else None)
    shared = args.moe_shared_expert_intermediate_size
    if shared:
        out += _linear(f"{p}.shared_experts.linear_fc1", glu * shared // tp, h, None)
        out += _linear(f"{p}.shared_experts.linear_fc2", h, shared // tp, None)
    return out


def model_shapes(args) -> list[tuple[str, Shapes]]:
    """(unit name, [(parameter name, TP-local shape)]) of a single-stage GPTModel, in the order
    and with the names of models/gpt/units.py: a tied word embedding is a unit of its own,
    first; the embedding unit holds what else the embedding has (dropped when empty)."""
    h, tied = args.hidden_size, not args.untie_embeddings_and_output_weights
    word = ("embedding.word_embeddings.weight", (args.padded_vocab_size // args.tensor_model_parallel_size, h))
    embedding = [] if tied else [word]
    if args.position_embedding_type == "learned_absolute":
        embedding.append(("embedding.position_embeddings.weight", (args.max_position_embeddings, h)))
    units = [("tied_embedding", [word])] if tied else []
    units += [("embedding", embedding)] if embedding else []
    units += [(f"layer{i + 1}", layer_shapes(args, i)) for i in range(args.num_layers)]
    final = _norm("decoder.final_layernorm", h, args.normalization == "LayerNorm")
    final += [] if tied else [("output_layer.weight", word[1])]
    return units + [("final", final)]


def get_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (Megatron-LM's flags and ours) plus --data-parallel-size."""
    from megatron_mfsdp.training.arguments import accepted, build_parser
    from megatron_mfsdp.training.arguments.types import positive_int

    p = build_parser()
    p.prog, p.usage = "tools/plan.py", "%(prog)s [pretrain_gpt.py's model flags] --data-parallel-size DP"
    p.description = __doc__.splitlines()[0]
    accepted.add_accepted_args(p)
    g = p.add_argument_group("tools/plan.py")
    g.add_argument(
        "--data-parallel-size", type=positive_int, required=True, help="DP ranks (world / (TP x PP)) to plan over"
    )
    g.add_argument(
        "--traffic",
        action="store_true",
        help="drive units of the plan through every DP rank's SegmentComm (fake process groups, shapes only) and "
        "print calls, the busiest rank's bytes against ZeRO-3's and the largest buffer per unit; at EP above 1 "
        "then the expert domain's units over the expert-DP ranks (RESULT line tagged domain=expert)",
    )
    g.add_argument(
        "--traffic-units",
        type=int,
        default=6,
        metavar="N",
        help="with --traffic: the first N - 1 units of each domain's plan (dense: embedding units, then layers; "
        "expert: MoE layers) and the last; 0: all",
    )
    g.add_argument(
        "--traffic-algorithm",
        type=algorithm_pair,
        default=(None, None),
        metavar="ALG[,ALG]",
        help="with --traffic: force the owner collectives of every unit (gather[,reduce]): parts (a call per "
        "owner part over all ranks), two_level (inside each node, then across nodes on rails) or padded (one "
        "all-gather / reduce-scatter of padded segments); auto: each unit's choice by the cost model on NCCL "
        "(--mfsdp-collectives auto; the choice table is printed); default parts (rank order keeps its chain "
        "unless forced)",
    )
    g.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --traffic: simulate nodes of N consecutive ranks of each shard group (two_level runs on them, "
        "and bytes are shown per level); default one node",
    )
    return p


def algorithm_pair(text: str) -> tuple[str, str]:
    """``ALG`` (both directions) or ``GATHER,REDUCE``: runtime/comm.py's algorithms."""
    from megatron_mfsdp.runtime.comm import ALGORITHMS

    if text == "auto":
        return "auto", "auto"
    names = text.split(",")
    if len(names) not in (1, 2) or any(n not in ALGORITHMS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: give ALG or GATHER,REDUCE, each one of {', '.join(ALGORITHMS)}")
    return names[0], names[-1]


def validate(args) -> None:
    """pretrain_gpt.py's checks that concern the model and its placement (training/arguments/
    validate.py, so the errors are the same); --seq-length and --max-position-embeddings are
    needed only for learned absolute position embeddings, the only shape they change."""
    from megatron_mfsdp.data.datasets import padded_vocab_size
    from megatron_mfsdp.optim import registry
    from megatron_mfsdp.placement.classes import parse_rule
    from megatron_mfsdp.training.arguments import validate as checks

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if pp != 1:
        raise ValueError(f"--pipeline-model-parallel-size {pp}: tools/plan.py plans one pipeline stage (give 1)")
    if args.vocab_size is None:
        raise ValueError("--vocab-size is required (the tokenizer's vocabulary, before padding)")
    if args.position_embedding_type != "learned_absolute" and not args.use_rotary_position_embeddings:
        args.seq_length = args.seq_length or 1
        args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.world_size, args.notices, args.explicit = tp * pp * args.data_parallel_size, [], []
    checks.validate_parallel(args)
    checks.validate_model(args)
    checks.validate_precision(args)
    checks.validate_device(args)  # what TransformerConfig accepts on this machine, as at start-up
    args.padded_vocab_size = padded_vocab_size(
        args.vocab_size, args.make_vocab_size_divisible_by, 1 if args.mfsdp_vocab_padding_independent_of_tp else tp
    )
    args.param_rules = [parse_rule(rule, registry.rule_names()) for rule in args.mfsdp_param_rule]
    # Matrices are costed by the Newton-Schulz run the optimizer will do; the plan is for a GPU
    # cluster, so without --muon-ns-dtype it is bf16 as on CUDA (fp32 with --muon-fp32-matmul-prec high).
    args.muon_ns_dtype = args.muon_ns_dtype or ("fp32" if args.muon_fp32_matmul_prec == "high" else "bf16")


def parse(argv: list[str] | None = None):
    """Parsed and validated flags; errors exit 2 naming the flag, as pretrain_gpt.py's."""
    from megatron_mfsdp.training.arguments import accepted

    parser = get_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(accepted.explain_unrecognized(extra))
    try:
        validate(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def meta_units(shapes) -> list:
    """ModelUnits of meta tensors of these shapes: what placement/specs.py: unit_specs reads
    (names and shapes), so the planner sees what MatrixFSDP sees at start-up."""
    import torch

    from megatron_mfsdp.models import ModelUnit

    def meta(name, shape):
        t = torch.empty(shape, device="meta")
        if ".mlp.experts." in name:
            t.allreduce = False  # megatron-core's mark of an expert parameter (runtime/wrapper.py: is_expert)
        return t

    return [ModelUnit(name, [(n, meta(n, shape)) for n, shape in params], []) for name, params in shapes]


def specs_from_args(args, units=None) -> list:
    """Planner specs of the model the (validated) flags describe, by the unit_specs MatrixFSDP plans from
    (placement/specs.py; with Q, K and V apart if --mfsdp-split-qkv-owners asks)."""
    from types import SimpleNamespace

    from megatron_mfsdp.models.gpt import GPT_ADAPTER
    from megatron_mfsdp.placement.specs import unit_specs
    from megatron_mfsdp.training.setup import runtime_config

    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    shape = SimpleNamespace(
        num_attention_heads=args.num_attention_heads, num_query_groups=groups, kv_channels=args.kv_channels
    )
    runtime = runtime_config(args, on_cpu=False)  # costed as a GPU cluster runs Newton-Schulz
    return unit_specs(units if units is not None else meta_units(model_shapes(args)), runtime, GPT_ADAPTER, shape)


def domain_units(args) -> dict[str, list]:
    """The model's units per shard domain, as MatrixFSDP splits them (runtime/wrapper.py:
    split_expert_units): everything "dense" at EP 1; at EP above 1 each MoE layer's experts "expert"."""
    from types import SimpleNamespace

    from megatron_mfsdp.runtime.wrapper import split_expert_units

    parts = split_expert_units(meta_units(model_shapes(args)), SimpleNamespace(ep_size=args.expert_model_parallel_size))
    out: dict[str, list] = {}
    for unit, domain in parts:
        out.setdefault(domain, []).append(unit)
    return out


def plan_from_args(args, domain: str = "dense", dense=None):
    """(planner specs, plan) of the (validated) flags in one shard domain: dense over DP /
    --mfsdp-replicate-size owners, experts over expert DP (world / (EP x expert TP)) / its
    gcd(--mfsdp-replicate-size, expert DP) replicas (megatron_mfsdp/groups.py), each owner's dense
    load (``dense``: the dense plan, planned here when not given) balanced against, as the runtime
    does (runtime/wrapper.py: _dense_loads) for the expert-DP group of global rank 0."""
    import math

    from megatron_mfsdp.placement import plan_units

    specs = specs_from_args(args, domain_units(args)[domain])
    world = args.data_parallel_size // args.mfsdp_replicate_size
    base = None
    if domain == "expert":
        expert_dp = args.tensor_model_parallel_size * args.data_parallel_size
        expert_dp //= args.expert_model_parallel_size * (
            args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        )
        world = expert_dp // math.gcd(args.mfsdp_replicate_size, expert_dp)
        base = expert_base(args, dense if dense is not None else plan_from_args(args)[1], world)
    plan = plan_units(specs, world, args.mfsdp_planner, base)
    plan.element_size = 2 if args.bf16 or args.fp16 else 4
    return specs, plan


def total_line(base, experts) -> str:
    """The expert owners' balance over both domains: dense load (``base``) plus expert load, per rank."""
    from megatron_mfsdp.placement.layout import balance

    weight = [b + e for b, e in zip(base.weight, experts.per_rank_weight())]
    cost = [b + e for b, e in zip(base.cost, experts.cost_per_rank)]
    return (
        f"both domains (dense + experts) on the expert owners of rank 0's group: max/mean bytes {balance(weight):.3f}, "
        f"NS flops {balance(cost):.3f}"
    )


def expert_base(args, dense, owners: int):
    """The dense loads of the expert owners of global rank 0's expert shard group, the largest over its
    expert TP peers' groups: megatron-core's rank generators (parallel_state.RankGenerator, one pipeline
    stage) place the ranks, groups.py splits the DP groups into shards."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_mfsdp.placement.planner import RankLoads

    tp, dp, ep = args.tensor_model_parallel_size, args.data_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    order = args.parallel_order
    dense_groups = RankGenerator(tp, 1, dp, 1, 1, order).get_ranks("dp")
    expert_gen = RankGenerator(etp, ep, tp * dp // (ep * etp), 1, 1, order)
    shard_of = {r: i % dense.world_size for g in dense_groups for i, r in enumerate(g)}  # dense shard rank
    expert_groups = expert_gen.get_ranks("dp")
    peers = next(g for g in expert_gen.get_ranks("tp") if 0 in g)
    cost, weight = [0] * owners, [0] * owners
    for group in (g for g in expert_groups if set(g) & set(peers)):
        first = next(r for r in group if r in peers)
        start = group.index(first) // owners * owners  # the shard holding the peer (groups.py's split)
        for i, r in enumerate(group[start : start + owners]):
            cost[i] = max(cost[i], dense.cost_per_rank[shard_of[r]])
            weight[i] = max(weight[i], dense.per_rank_weight()[shard_of[r]])
    return RankLoads(tuple(cost), tuple(weight))


def report(args, specs, plan, domain: str = "dense") -> str:
    """The start-up plan line and table, preceded by the model and followed by the lower bounds; the
    expert domain's (at EP above 1) after the dense one's."""
    from megatron_mfsdp.placement import WHOLE
    from megatron_mfsdp.placement.bounds import plan_bounds

    total = sum(p.numel for u in specs for p in u.params)
    matrices = sum(p.numel for u in specs for p in u.params if p.storage == WHOLE)
    bounds = plan_bounds(specs, plan.world_size)
    if domain == "expert":
        ep, local = args.expert_model_parallel_size, args.num_experts // args.expert_model_parallel_size
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        expert_dp = args.tensor_model_parallel_size * args.data_parallel_size // (ep * etp)
        over = f"owners over expert DP {expert_dp}"
        if plan.world_size != expert_dp:
            over = f"expert DP {expert_dp} as {expert_dp // plan.world_size} replicas of {plan.world_size} owners"
        return "\n".join(
            [
                f"experts: EP {ep} ({local} experts per rank), expert TP {etp}, {over}: {total:,} "
                "expert parameters per rank",
                "> pipeline stage 0, expert domain: " + plan.report(),
                f"lower bounds: bytes {bounds.bytes:.3f}, NS flops {bounds.ns_flops:.3f} (max/mean no plan can beat)",
            ]
        )
    return "\n".join(
        [
            f"GPT {args.num_layers} layers, hidden {args.hidden_size}, TP {args.tensor_model_parallel_size}, "
            f"DP {args.data_parallel_size} (owners over {plan.world_size}): {total:,} parameters per TP rank, "
            f"{matrices / max(total, 1):.1%} in whole matrices; NS flops as {args.muon_num_ns_steps} Newton-Schulz "
            f"steps in {args.muon_ns_dtype} ({args.muon_ns_algorithm}) cost them",
            "> pipeline stage 0: " + plan.report(),
            f"lower bounds: bytes {bounds.bytes:.3f}, NS flops {bounds.ns_flops:.3f} (max/mean no plan can beat)",
        ]
    )


def traffic(args, plan, domain: str = "dense") -> tuple[str, list]:
    """The --traffic table of one shard domain: units of its plan through every rank's SegmentComm on the
    fake backend (the DP ranks for "dense", the expert-DP ranks for "expert": one domain's collectives
    run over its own shard group, with the same comm), in the reduce order a GPU cluster runs
    (--mfsdp-reduce-order, auto: ring on NCCL)."""
    import torch

    from megatron_mfsdp.runtime.at_scale import Collectives, simulate
    from megatron_mfsdp.runtime.comm import resolve_reduce_order

    n, count = args.traffic_units, len(plan.units)
    units = list(range(count)) if n <= 0 or n >= count else list(range(n - 1)) + [count - 1]
    order = resolve_reduce_order(args.mfsdp_reduce_order, "nccl")
    param = {2: torch.bfloat16, 4: torch.float32}[plan.element_size]
    grad = param if (args.bf16 or args.fp16) and args.grad_reduce_in_bf16 else torch.float32
    how, chosen = Collectives(force=tuple(args.traffic_algorithm), ranks_per_node=args.ranks_per_node), ""
    if how.force[0] == "auto":
        how, chosen = by_cost(args, plan, order, param.itemsize, grad.itemsize)
    rows = simulate(plan, units, param, grad, order, how)
    table = chosen + traffic_table(rows, plan.world_size, order, (param, grad), count, domain)
    if any(a is not None for a in how.force) or args.ranks_per_node or chosen:
        table += "\n" + levels_table(rows, how)
    return table, rows


def by_cost(args, plan, order: str, param_bytes: int, grad_bytes: int):
    """(Collectives, the choice table) of --traffic-algorithm auto: the runtime's choice on NCCL
    (placement/collectives.py, as build_domain makes it), with its predicted time per algorithm."""
    from megatron_mfsdp.placement.collectives import choose_collectives
    from megatron_mfsdp.runtime.at_scale import Collectives

    per_node = args.ranks_per_node or plan.world_size
    plan.collectives = choose_collectives(plan, per_node, "nccl", "auto", order, param_bytes, grad_bytes)
    how = Collectives(algorithms=plan.collectives.choices(), ranks_per_node=args.ranks_per_node)
    return how, plan.collectives.report() + "\n"


def levels_table(rows, how) -> str:
    """Per unit and level (flat: calls over the whole shard group; intra: inside a node; inter: across
    nodes), the busiest rank's bytes against ZeRO-3's bytes per rank, gather and reduction."""
    gather, reduce = how.force[0] or "parts", how.force[1] or "parts"
    if how.algorithms:  # by cost: each unit its own (the choice table above)
        gather = reduce = "by-cost"
    lines = [
        f"per level (algorithms: gather {gather}, reduce {reduce}; {how.ranks_per_node or 'all'} ranks per node): "
        "the busiest rank's bytes on each level / ZeRO-3's bytes per rank"
    ]
    worst: dict = {}
    for r in rows:
        cells = []
        for op, levels, zero3 in (
            ("gather", r.gather_levels, r.zero3_gather),
            ("reduce", r.reduce_levels, r.zero3_reduce),
        ):
            for level, moved in levels.items():
                cells.append(f"{op} {level} {moved / zero3:.3f}")
                worst[(op, level)] = max(worst.get((op, level), 0.0), moved / zero3)
        algorithms = "/".join(how.chosen(r.index, reduce) for reduce in (False, True))
        lines.append(f"{r.name:>16} {algorithms:<20} calls g/r {r.gather_calls}/{r.reduce_calls}: " + ", ".join(cells))
    summary = " ".join(f"max_{op}_{level}_over_zero3={v:.3f}" for (op, level), v in sorted(worst.items()))
    lines.append(
        f"RESULT traffic levels gather={gather} reduce={reduce} ranks_per_node={how.ranks_per_node} {summary} "
        f"max_calls_per_op={max(max(r.gather_calls, r.reduce_calls) for r in rows)}"
    )
    return "\n".join(lines)


def traffic_table(rows, w: int, order: str, dtypes, count: int, domain: str = "dense") -> str:
    """The table and its RESULT line; the expert domain's are marked as such (``domain=expert`` in the
    RESULT line, after ``traffic``), the dense domain's are as they were before experts had one."""
    param, grad = dtypes
    where, tag = ("DP", "") if domain == "dense" else (f"{domain} DP", f"domain={domain} ")
    lines = [
        f"traffic at {where} {w} (every rank's SegmentComm on fake process groups; reduce order {order}; gather in "
        f"{str(param)[6:]}, reduction in {str(grad)[6:]}), {len(rows)} of {count} units; busiest = the largest of any "
        f"rank's bytes in or out; ZeRO-3's per rank is (W - 1) / W of a unit, so one unit is {w / (w - 1):.3f}x; "
        f"buffer = the largest buffer any rank allocated, over the unit's gradient bytes",
        f"{'unit':>16} {'elements':>13} {'owners':>6} {'calls g/r':>9} {'gather/ZeRO-3':>13} {'reduce/ZeRO-3':>13} "
        f"{'buffer/unit':>14}",
    ]
    for r in rows:
        lines.append(
            f"{r.name:>16} {r.numel:>13,} {r.parts:>6} {f'{r.gather_calls}/{r.reduce_calls}':>9} "
            f"{r.gather_busiest / r.zero3_gather:>13.3f} {r.reduce_busiest / r.zero3_reduce:>13.3f} "
            f"{r.transient / (r.numel * grad.itemsize):>14.3f}"
        )
    gather = max(r.gather_busiest / r.zero3_gather for r in rows)
    reduce = max(r.reduce_busiest / r.zero3_reduce for r in rows)
    calls = max(max(r.gather_calls, r.reduce_calls) for r in rows)
    transient = max(r.transient / (r.numel * grad.itemsize) for r in rows)
    lines.append(
        f"RESULT traffic {tag}dp={w} order={order} units={len(rows)} max_gather_over_zero3={gather:.3f} "
        f"max_reduce_over_zero3={reduce:.3f} max_calls_per_op={calls} max_transient_over_unit={transient:.4f} "
        f"as_predicted={all(r.as_predicted is not False for r in rows)}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # megatron-core's fallback warnings (its import, even for --help): one line at the end
    # (-W or PYTHONWARNINGS: Python's own output)
    with warnings.catch_warnings(record=not sys.warnoptions) as caught:
        try:
            return run(argv)
        finally:
            from megatron_mfsdp.compat.fallbacks import report

            report(caught, "tools/plan.py")


def run(argv: list[str] | None = None) -> int:
    """Parse, plan and print the report (and the traffic with --traffic)."""
    args = parse(argv)
    specs, plan = plan_from_args(args)
    print(report(args, specs, plan))
    experts = plan_from_args(args, "expert", plan) if "expert" in domain_units(args) else None
    if experts:
        print(report(args, *experts, domain="expert"))
        print(total_line(expert_base(args, plan, experts[1].world_size), experts[1]))
    if args.traffic:
        print(traffic(args, plan)[0])
        if experts:
            print(traffic(args, experts[1], "expert")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
