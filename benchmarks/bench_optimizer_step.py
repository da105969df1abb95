"""Time the optimizer step of MatrixFSDP against two Muon baselines, in one run.

For each data-parallel size W (gloo, CPU) the same GPT-shaped matrices, the
same reduced gradients and the same hyperparameters go through three optimizers:

ours        MatrixFSDP + MatrixFSDPOptimizer: every Muon matrix lives whole on
            one owner rank, which runs Muon on it locally; the only collective
            is one all-reduce of 2 scalars (grad stats).
recon       the reconstruction baseline (FSDP2-style ZeRO-3 Muon): every matrix
            is stored as even flat shards (numel/W per rank, padded to a multiple
            of W); per step and per matrix the rank updates its momentum shard,
            all-gathers the full Nesterov direction (same size as the gradient,
            and the momentum stays sharded), runs the same Newton-Schulz math on
            every rank and keeps the local slice of the update.
replicated  plain data parallelism: every rank holds every full matrix and runs
            Muon on all of them (gradients assumed all-reduced already).

All three include the same non-Muon work: AdamW on the tail (embeddings,
norms, biases; ``ours`` on its even tail slice, ``recon`` on its even shards,
``replicated`` on the full tensors) and a global gradient norm (``ours``: its
grad stats + 2-scalar all-reduce, ``recon``: local sum of squares + a 1-scalar
all-reduce, ``replicated``: local). clip_grad is 0, no loss scaling.

Gradients come from one real forward/backward of a megatron-core GPT through
MatrixFSDP; the baselines get exactly those reduced gradients (gathered from
the owners before timing). Timed steps are interleaved (ours, recon,
replicated per iteration) after a barrier; a step's time is the maximum over
ranks. After timing, the parameters of the three are compared (they ran the same
number of steps from the same state, so they should agree).

Then every rule (``--rules``, default: every --optimizer value): the owner layout against
``--mfsdp-layout even`` (each rule's reconstruction variant in our own runtime: gradients or
momentum gathered over DP per matrix, the rule's math on every rank that holds a slice, its
non-elementwise state replicated there), from the same weights and reduced gradients: step ms
(slowest rank, median), collectives and bytes moved per step (busiest rank), bytes held per rank
(busiest rank; optimizer state apart), and that both end with bitwise equal weights.

``--batched``: batched directions against the per-matrix loop, per rule with a batched hook
(optim/matrix.py MatrixMath.batched): ``--batched-count`` same-shape matrices (default 64 of
512 x 1408, an expert's size in a small MoE) on one owner in one process, one step each way from
the same state after a first untimed step (SOAP's first is its eigh); the median step ms of each,
their ratio, and how far the batched weights end from the loop's (bitwise where the kernels allow).

``--moe``: a small MoE GPT (``--moe-experts`` experts, top ``--moe-topk``) at EP ``--moe-ep`` on
``--moe-world-size`` ranks through MatrixFSDP (dense matrices over DP, experts over expert DP): ours
against the even layout with reconstruction (FSDP2-style, per domain over its group) and against a
layer-wise full replica (Megatron-LM HEAD's LayerWiseDistributedOptimizer: each matrix stepped by one
owner, then an all-gather of the updated tensors), from the same weights and reduced gradients: step ms
(slowest rank, median), bytes held and sent (busiest rank), collectives, and that all three end equal.

Run from the repository root:

    .venv/bin/python benchmarks/bench_optimizer_step.py            # W = 2 and 4
    .venv/bin/python benchmarks/bench_optimizer_step.py --quick    # CI smoke, < 60 s
    .venv/bin/python benchmarks/bench_optimizer_step.py --rules soap shampoo --skip-muon-baselines
    .venv/bin/python benchmarks/bench_optimizer_step.py --batched [--batched-count 64 --batched-shape 512 1408]
    .venv/bin/python benchmarks/bench_optimizer_step.py --moe     # W = 4, EP 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from megatron_mfsdp.config import muon_rule_set
from megatron_mfsdp.optim import muon, registry
from megatron_mfsdp.optim.muon import MuonSettings
from megatron_mfsdp.optim.newton_schulz import NS_COEFFICIENTS, NS_DTYPES, NewtonSchulzCost
from megatron_mfsdp.placement import POLICIES
from megatron_mfsdp.placement.classes import MATRIX
from megatron_mfsdp.testing import count_collectives, run_workers
from megatron_mfsdp.testing.baselines import BaselineHyper, ReconstructionMuon, ReplicatedMuon

METHODS = ("ours", "recon", "replicated")


# --------------------------------------------------------------------------- helpers
def spawn(world_size: int, threads: int, fn, *args, timeout: float = 1800):
    """Rank 0's result of ``fn`` run on ``world_size`` gloo processes."""
    return run_workers(world_size, fn, *args, threads=threads, timeout=timeout, fresh=True)[0]


# --------------------------------------------------------------------------- worker
def _full_by_name(ddp, buffers):
    return {
        slot.name: buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
        for state, buf in zip(ddp.units, buffers)
        for slot in state.layout.slots
    }


def _worker(rank, world, a):
    from megatron.core import parallel_state

    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, MatrixFSDPOptimizerConfig, get_megatron_optimizer
    from megatron_mfsdp.models.gpt import build_gpt_model
    from megatron_mfsdp.optim.optimizer import no_weight_decay
    from megatron_mfsdp.testing import tiny_gpt_config

    log = print if rank == 0 else (lambda *x, **k: None)
    parallel_state.initialize_model_parallel(1, 1)
    group = parallel_state.get_data_parallel_group()

    torch.manual_seed(a["seed"])
    config = tiny_gpt_config(
        num_layers=a["num_layers"],
        hidden_size=a["hidden_size"],
        ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"],
    )
    model = build_gpt_model(config, vocab_size=a["vocab_size"], max_sequence_length=a["seq_length"])
    ns = NewtonSchulzCost(a["ns_steps"], a["ns_dtype"], "auto", on_cpu=True)
    rules = muon_rule_set(ns, a["split_qkv"])
    ddp = MatrixFSDP(config, MatrixFSDPConfig(planner=a["planner"], rules=rules), model)
    opt_cfg = MatrixFSDPOptimizerConfig(
        optimizer="muon",
        muon_momentum=0.95,
        muon_use_nesterov=True,
        muon_extra_scale_factor=0.2,
        lr=1e-2,
        min_lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.0,
        muon_num_ns_steps=a["ns_steps"],
        rule_settings={"muon": MuonSettings(a["coefficients"], a["ns_dtype"], "auto")},
        muon_split_qkv=a["split_qkv"],
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
    )
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    hyper = BaselineHyper(opt_cfg)

    # One real forward/backward (different tokens per rank), reduced onto the owners.
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, a["vocab_size"], (a["micro_batch_size"], a["seq_length"]), generator=g)
    positions = torch.arange(a["seq_length"]).expand_as(tokens)
    opt.zero_grad()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    saved_grads = [state.grad_segment.clone() for state in ddp.units]

    # The same matrices, values and reduced gradients for the baselines, in model order.
    full_params = _full_by_name(ddp, ddp.gathered("param"))
    full_grads = _full_by_name(ddp, ddp.gathered("grad"))
    matrices, tail = [], []
    for state in ddp.units:
        slots = {slot.name: slot for slot in state.layout.slots}
        for name, _ in state.unit.params:
            p, gr = full_params[name], full_grads[name]
            if slots[name].rule == MATRIX:
                matrices.append((name, tuple(p.shape), slots[name].split_rows, p, gr))
            else:
                tail.append((name, 0.0 if no_weight_decay(name, p.shape) else hyper.wd, p, gr))
    for name, wd, _, _ in tail:  # the tail's decay groups must agree with ours
        assert (wd == 0.0) == no_weight_decay(name, full_params[name].shape)
    replicated = ReplicatedMuon(matrices, tail, hyper)
    recon = ReconstructionMuon(matrices, tail, hyper, group, rank, world, prefetch=a["recon_prefetch"])

    log(
        f"\n=== W={world}: {world} gloo ranks x {torch.get_num_threads()} thread(s), "
        f"{len(matrices)} Muon matrices ({sum(p.numel() for _, _, _, p, _ in matrices):,} elements), "
        f"tail {len(tail)} tensors ({sum(p.numel() for _, _, p, _ in tail):,} elements), "
        f"NS {a['ns_steps']} steps {a['ns_dtype']} '{a['coefficients']}', split_qkv={a['split_qkv']}"
    )
    log("matrix shapes: " + ", ".join(sorted({f"{s[0]}x{s[1]}" for _, s, _, _, _ in matrices})))
    log(ddp.plan.report())

    def run_ours():
        for state, saved in zip(ddp.units, saved_grads):
            state.grad_segment.copy_(saved)  # untimed: the step does not change them with clip 0
        dist.barrier(group=group)
        t0 = time.perf_counter()
        ok, norm, _ = opt.step()
        dt = time.perf_counter() - t0
        assert ok
        return dt, norm

    def run_baseline(b):
        def run():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            norm = b.step()
            return time.perf_counter() - t0, norm

        return run

    runners = {"ours": run_ours, "recon": run_baseline(recon), "replicated": run_baseline(replicated)}
    times = {m: [] for m in METHODS}
    norms = {}
    collectives = {}
    for it in range(a["warmup"] + a["iters"]):
        for m in METHODS:
            if it == 0:
                with count_collectives() as calls:
                    dt, norms[m] = runners[m]()
                collectives[m] = calls.summary()
            else:
                dt, norms[m] = runners[m]()
            if it >= a["warmup"]:
                times[m].append(dt)

    # Step time of an iteration = the slowest rank's.
    local = torch.tensor([times[m] for m in METHODS], dtype=torch.float64)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local, group=group)
    stacked = torch.stack(everyone)  # [rank, method, iter]
    slowest = stacked.max(dim=0).values
    stats = {}
    for i, m in enumerate(METHODS):
        ms = [1e3 * v for v in slowest[i].tolist()]
        per_rank = [1e3 * statistics.median(stacked[r, i].tolist()) for r in range(world)]
        stats[m] = {"median": statistics.median(ms), "min": min(ms), "per_rank_median": per_rank}

    # Correctness: every method took the same number of steps from the same state.
    ours_full = _full_by_name(ddp, ddp.gathered("param"))
    rep_full = replicated.full_params()
    rec_full = recon.full_params()
    diff_ours = max((ours_full[n].reshape(-1) - rep_full[n].reshape(-1)).abs().max().item() for n in rep_full)
    diff_recon = max((rec_full[n].reshape(-1) - rep_full[n].reshape(-1)).abs().max().item() for n in rep_full)

    # Bytes per rank (persistent: params + grads + fp32 masters + optimizer state).
    ours_bytes = {**ddp.local_bytes(), **opt.local_bytes()}
    bytes_local = torch.tensor(
        [sum(ours_bytes.values()), sum(recon.local_bytes().values()), sum(replicated.local_bytes().values())],
        dtype=torch.float64,
    )
    bytes_all = [torch.empty_like(bytes_local) for _ in range(world)]
    dist.all_gather(bytes_all, bytes_local, group=group)
    bytes_stack = torch.stack(bytes_all)

    # Breakdown of ours (untimed above; run after the comparison): grad stats vs. local updates,
    # and the bare Newton-Schulz loop over owned matrices vs. over all matrices.
    owned = [p for p in opt.owned_pieces() if p.rule == "muon"]
    owned_dirs = [p.grad for p in owned]
    owned_qkv = [p.split_rows for p in owned]
    all_dirs = [(gr, q) for _, _, q, _, gr in matrices]

    def ns_loop(items):
        for m, q in items:
            muon.direction(m, {}, hyper.muon, 0, q)

    parts = {"stats": [], "update": [], "ns_owned": [], "ns_all": []}
    for it in range(1 + max(3, a["iters"] // 2)):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        opt.prepare_grads()
        t1 = time.perf_counter()
        opt.step_with_ready_grads()
        t2 = time.perf_counter()
        dist.barrier(group=group)
        t3 = time.perf_counter()
        ns_loop(list(zip(owned_dirs, owned_qkv)))
        t4 = time.perf_counter()
        dist.barrier(group=group)
        t5 = time.perf_counter()
        ns_loop(all_dirs)
        t6 = time.perf_counter()
        if it:
            for k, v in (("stats", t1 - t0), ("update", t2 - t1), ("ns_owned", t4 - t3), ("ns_all", t6 - t5)):
                parts[k].append(v)
    part_local = torch.tensor([statistics.median(parts[k]) for k in parts], dtype=torch.float64)
    part_all = [torch.empty_like(part_local) for _ in range(world)]
    dist.all_gather(part_all, part_local, group=group)
    part_max = torch.stack(part_all).max(dim=0).values
    breakdown = {k: 1e3 * part_max[i].item() for i, k in enumerate(parts)}

    return {
        "W": world,
        "threads": torch.get_num_threads(),
        "stats": stats,
        "bytes_max": {m: int(bytes_stack[:, i].max().item()) for i, m in enumerate(METHODS)},
        "bytes_ours_per_rank": [int(v) for v in bytes_stack[:, 0].tolist()],
        "ours_bytes_detail_rank0": ours_bytes,
        "collectives": collectives,
        "norms": norms,
        "diff_ours": diff_ours,
        "diff_recon": diff_recon,
        "breakdown": breakdown,
        "report": ddp.plan.report(),
        "recon_gather_buffer_max_bytes": max(4 * (-(-p.numel() // world)) * world for _, _, _, p, _ in matrices),
    }


# --------------------------------------------------------------------------- MoE: owner vs even vs layer-wise
MOE_METHODS = ("ours", "recon", "layerwise")


class _Both:
    """A baseline of each shard domain (dense over DP, experts over expert DP), stepped one after the other."""

    def __init__(self, parts):
        self.parts = parts

    def step(self) -> float:
        return math.sqrt(sum(p.step() ** 2 for p in self.parts))

    def full_params(self):
        return {k: v for p in self.parts for k, v in p.full_params().items()}

    def local_bytes(self):
        out = {}
        for p in self.parts:
            for k, v in p.local_bytes().items():
                out[k] = out.get(k, 0) + v
        return out


def _moe_worker(rank, world, a):
    """A small MoE GPT at EP ``moe_ep`` on ``world`` ranks through MatrixFSDP (dense domain over DP, expert
    domain over expert DP); one real forward/backward; then timed steps of ours, the even layout with
    reconstruction and a layer-wise full replica, from the same weights and reduced gradients."""
    from megatron.core import parallel_state as ps

    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from megatron_mfsdp.compat.cpu import cuda_on_cpu
    from megatron_mfsdp.groups import initialize_model_parallel
    from megatron_mfsdp.models.gpt import build_gpt_model
    from megatron_mfsdp.optim.optimizer import no_weight_decay
    from megatron_mfsdp.testing import optimizer_config, tiny_gpt_config
    from megatron_mfsdp.testing.baselines import LayerWiseMuon

    initialize_model_parallel(1, 1, expert_model_parallel_size=a["moe_ep"], create_gloo_process_groups=False)
    groups = {"dense": ps.get_data_parallel_group(), "expert": ps.get_expert_data_parallel_group()}
    torch.manual_seed(a["seed"])
    config = tiny_gpt_config(
        num_layers=a["num_layers"],
        hidden_size=a["hidden_size"],
        ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"],
        num_moe_experts=a["moe_experts"],
        moe_router_topk=a["moe_topk"],
        moe_ffn_hidden_size=a["moe_ffn_hidden_size"],
        expert_model_parallel_size=a["moe_ep"],
        add_bias_linear=False,
    )
    model = build_gpt_model(config, vocab_size=a["vocab_size"], max_sequence_length=a["seq_length"])
    ns = NewtonSchulzCost(a["ns_steps"], a["ns_dtype"], "auto", on_cpu=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(planner=a["planner"], rules=muon_rule_set(ns, a["split_qkv"])), model)
    settings = {"muon_ns_dtype": a["ns_dtype"], "muon_coefficient_type": a["coefficients"]}
    opt_cfg = optimizer_config(weight_decay=0.1, muon_split_qkv=a["split_qkv"], **settings)
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    hyper = BaselineHyper(opt_cfg)
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, a["vocab_size"], (a["micro_batch_size"], a["seq_length"]), generator=g)
    opt.zero_grad()
    with cuda_on_cpu():  # megatron-core's router moves its weight to torch.cuda.current_device()
        ddp(tokens, torch.arange(a["seq_length"]).expand_as(tokens), None, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    saved = [state.grad_segment.clone() for state in ddp.units]
    params, grads = _full_by_name(ddp, ddp.gathered("param")), _full_by_name(ddp, ddp.gathered("grad"))
    split = {name: ([], []) for name in groups}  # domain -> (matrices, tail)
    for state in ddp.units:
        matrices, tail = split[state.domain.name]
        for slot in state.layout.slots:
            p, gr = params[slot.name], grads[slot.name]
            if slot.rule == MATRIX:
                matrices.append((slot.name, tuple(p.shape), slot.split_rows, p, gr))
            else:
                tail.append((slot.name, 0.0 if no_weight_decay(slot.name, p.shape) else hyper.wd, p, gr))
    mine = {name: dist.get_rank(group) for name, group in groups.items()}
    sizes = {name: dist.get_world_size(group) for name, group in groups.items()}
    baselines = {
        "recon": _Both(
            [ReconstructionMuon(*split[d], hyper, groups[d], mine[d], sizes[d]) for d in groups if split[d][0]]
        ),
        "layerwise": _Both(
            [LayerWiseMuon(*split[d], hyper, groups[d], mine[d], sizes[d]) for d in groups if split[d][0]]
        ),
    }

    def run_ours():
        for state, grad in zip(ddp.units, saved):
            state.grad_segment.copy_(grad)
        dist.barrier()
        t0 = time.perf_counter()
        assert opt.step()[0]
        return time.perf_counter() - t0

    def run_baseline(b):
        def run():
            dist.barrier()
            t0 = time.perf_counter()
            b.step()
            return time.perf_counter() - t0

        return run

    runners = {"ours": run_ours} | {m: run_baseline(b) for m, b in baselines.items()}
    times, calls = {m: [] for m in MOE_METHODS}, {}
    for it in range(a["warmup"] + a["iters"]):
        for m in MOE_METHODS:
            if it == 0:
                with count_collectives() as log:
                    runners[m]()
                calls[m] = log
            else:
                dt = runners[m]()
                if it >= a["warmup"]:
                    times[m].append(dt)
    local = torch.tensor([times[m] for m in MOE_METHODS], dtype=torch.float64)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    slowest = torch.stack(everyone).max(dim=0).values  # [method, iteration]: the slowest rank's step
    ours_full = _full_by_name(ddp, ddp.gathered("param"))
    diffs = {}
    for m, b in baselines.items():
        theirs = b.full_params()
        diffs[m] = max((ours_full[n].reshape(-1) - t.reshape(-1)[: ours_full[n].numel()]).abs().max().item()
                       for n, t in theirs.items())  # fmt: skip
    held = {"ours": sum({**ddp.local_bytes(), **opt.local_bytes()}.values())}
    held |= {m: sum(b.local_bytes().values()) for m, b in baselines.items()}
    held_t = torch.tensor([held[m] for m in MOE_METHODS], dtype=torch.float64)
    held_all = [torch.empty_like(held_t) for _ in range(world)]
    dist.all_gather(held_all, held_t)
    moved = torch.tensor([[sum(c.link[1] for c in calls[m]) for m in MOE_METHODS]], dtype=torch.float64)
    moved_all = [torch.empty_like(moved) for _ in range(world)]
    dist.all_gather(moved_all, moved)
    return {
        "W": world,
        "threads": torch.get_num_threads(),
        "ms": {m: 1e3 * statistics.median(slowest[i].tolist()) for i, m in enumerate(MOE_METHODS)},
        "held": {m: int(torch.stack(held_all)[:, i].max()) for i, m in enumerate(MOE_METHODS)},
        "moved": {m: int(torch.cat(moved_all)[:, i].max()) for i, m in enumerate(MOE_METHODS)},
        "calls": {m: calls[m].summary() for m in MOE_METHODS},
        "diffs": diffs,
        "domains": {d: (len(split[d][0]), sizes[d]) for d in groups},
        "expert_matrices_owned": sum(
            1 for p in opt.owned_pieces() if p.rule == "muon" and ".experts." in p.global_name
        ),
    }


def run_moe(args, worker_args) -> dict:
    """The --moe table: owner against even-with-reconstruction and layer-wise on a small MoE."""
    W = args.moe_world_size
    a = worker_args | {k: getattr(args, k) for k in ("moe_ep", "moe_experts", "moe_topk", "moe_ffn_hidden_size")}
    r = spawn(W, max(1, args.cpus // W), _moe_worker, a, timeout=args.timeout)
    (dense, dp), (experts, edp) = r["domains"]["dense"], r["domains"]["expert"]
    print(
        f"\n=== MoE at W={W}: EP {args.moe_ep} x expert DP {edp} ({args.moe_experts} experts, top-{args.moe_topk}, "
        f"expert FFN {args.moe_ffn_hidden_size}), dense DP {dp}; {dense} dense and {experts} expert Muon matrices "
        f"on this EP rank; {r['threads']} thread(s) a rank ==="
    )
    print(f"{'method':<10} {'median ms':>10} {'x ours':>7} {'held MiB (max)':>15} {'sent MiB (max)':>15}  collectives")
    for m in MOE_METHODS:
        n, by_name = r["calls"][m]
        detail = ", ".join(f"{k} x{c}" for k, (c, _) in sorted(by_name.items())) or "-"
        print(
            f"{m:<10} {r['ms'][m]:>10.1f} {r['ms'][m] / r['ms']['ours']:>7.2f} {r['held'][m] / 2**20:>15.2f} "
            f"{r['moved'][m] / 2**20:>15.3f}  {n}: {detail}"
        )
    print("check: max |ours - baseline| after all steps: " + ", ".join(f"{m} {d:.2e}" for m, d in r["diffs"].items()))
    print(
        f"RESULT moe W={W} ep={args.moe_ep} ours_ms={r['ms']['ours']:.2f} recon_ms={r['ms']['recon']:.2f} "
        f"layerwise_ms={r['ms']['layerwise']:.2f} recon_over_ours={r['ms']['recon'] / r['ms']['ours']:.3f} "
        f"layerwise_over_ours={r['ms']['layerwise'] / r['ms']['ours']:.3f} "
        + " ".join(f"{m}_collectives={r['calls'][m][0]}" for m in MOE_METHODS)
        + " "
        + " ".join(f"{m}_diff={d:.3e}" for m, d in r["diffs"].items())
    )
    sys.stdout.flush()
    return r


# --------------------------------------------------------------------------- every rule: owner vs even
def _rule_build(a, layout: str, optimizer: str):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from megatron_mfsdp.models.gpt import build_gpt_model
    from megatron_mfsdp.testing import optimizer_config, tiny_gpt_config

    torch.manual_seed(a["seed"])
    shape = {k: a[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")}
    config = tiny_gpt_config(**shape, num_query_groups=a["num_query_groups"])
    model = build_gpt_model(config, vocab_size=a["vocab_size"], max_sequence_length=a["seq_length"])
    cfg = optimizer_config(
        optimizer=optimizer, muon_ns_dtype=a["ns_dtype"], muon_num_ns_steps=a["ns_steps"], lr=1e-3, min_lr=1e-3
    )
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout, rules=registry.rule_set((), cfg, layout)), model)
    return ddp, get_megatron_optimizer(cfg, [ddp])


def _max_over_ranks(values, group) -> list[float]:
    local = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    return torch.stack(everyone).max(dim=0).values.tolist()


def _rules_worker(rank, world, a, optimizers):
    """Every rule of ``optimizers`` on one set of processes (a fresh set per rule spent 4 s starting)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    group = parallel_state.get_data_parallel_group()
    return [_rule_run(rank, world, a, optimizer, group) for optimizer in optimizers]


def _rule_run(rank, world, a, optimizer, group):
    """Owner and even layouts of one rule, the same weights and reduced gradients, steps interleaved."""
    runs = {layout: _rule_build(a, layout, optimizer) for layout in ("owner", "even")}
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, a["vocab_size"], (a["micro_batch_size"], a["seq_length"]), generator=g)
    positions = torch.arange(a["seq_length"]).expand_as(tokens)
    saved = {}
    for layout, (ddp, opt) in runs.items():
        opt.zero_grad()
        ddp(tokens, positions, None, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        saved[layout] = [state.grad_segment.clone() for state in ddp.units]
    times, calls = {layout: [] for layout in runs}, {}
    for it in range(a["warmup"] + a["iters"]):
        for layout, (ddp, opt) in runs.items():
            for state, grads in zip(ddp.units, saved[layout]):
                state.grad_segment.copy_(grads)
            dist.barrier(group=group)
            with count_collectives() as log:
                t0 = time.perf_counter()
                assert opt.step()[0]
                dt = time.perf_counter() - t0
            calls[layout] = (len(log), sum(c.nbytes for c in log))
            if it >= a["warmup"]:
                times[layout].append(dt)
    slowest = {layout: statistics.median(_max_over_ranks(t, group)) * 1e3 for layout, t in times.items()}
    held = {}
    for layout, (ddp, opt) in runs.items():
        total, state = sum({**ddp.local_bytes(), **opt.local_bytes()}.values()), opt.local_bytes()["optimizer_state"]
        held[layout] = _max_over_ranks([total, state, *calls[layout]], group)
    owner_w, even_w = (ddp.full_state_dict() for ddp, _ in runs.values())
    equal = all(torch.equal(owner_w[k], even_w[k]) for k in owner_w)
    return {"optimizer": optimizer, "W": world, "ms": slowest, "held": held, "equal": equal}


def run_rules(args, worker_args) -> list[dict]:
    by_world = {}
    for W in args.world_sizes:
        threads = max(1, args.cpus // W)
        timeout = args.timeout * len(args.rules)
        by_world[W] = spawn(W, threads, _rules_worker, worker_args, list(args.rules), timeout=timeout)
    out = [by_world[W][i] for i in range(len(args.rules)) for W in args.world_sizes]
    print("\n=== every rule: owner layout vs --mfsdp-layout even (reconstruction), same weights and gradients ===")
    print(
        f"{'optimizer':<14} {'W':>2} {'owner ms':>9} {'even ms':>9} {'even/owner':>10} {'coll. owner/even':>16} "
        f"{'moved MiB owner/even':>21} {'held MiB owner/even':>20} {'state MiB owner/even':>21} bitwise"
    )
    for r in out:
        o, e = r["held"]["owner"], r["held"]["even"]
        print(
            f"{r['optimizer']:<14} {r['W']:>2} {r['ms']['owner']:>9.1f} {r['ms']['even']:>9.1f} "
            f"{r['ms']['even'] / r['ms']['owner']:>10.2f} {f'{o[2]:.0f}/{e[2]:.0f}':>16} "
            f"{f'{o[3] / 2**20:.2f}/{e[3] / 2**20:.2f}':>21} {f'{o[0] / 2**20:.2f}/{e[0] / 2**20:.2f}':>20} "
            f"{f'{o[1] / 2**20:.2f}/{e[1] / 2**20:.2f}':>21} {'yes' if r['equal'] else 'NO'}"
        )
    for r in out:
        print(
            f"RULE optimizer={r['optimizer']} W={r['W']} owner_ms={r['ms']['owner']:.2f} even_ms={r['ms']['even']:.2f} "
            f"even_over_owner={r['ms']['even'] / r['ms']['owner']:.3f} owner_bytes={int(r['held']['owner'][0])} "
            f"even_bytes={int(r['held']['even'][0])} owner_state_bytes={int(r['held']['owner'][1])} "
            f"even_state_bytes={int(r['held']['even'][1])} owner_moved={int(r['held']['owner'][3])} "
            f"even_moved={int(r['held']['even'][3])} bitwise={r['equal']}"
        )
    sys.stdout.flush()
    return out


# --------------------------------------------------------------------------- batched directions
BATCHED_RULES = {
    "muon": {},
    "adaptive_muon adamuon": {"optimizer": "adaptive_muon"},
    "adaptive_muon normuon": {"optimizer": "adaptive_muon", "adaptive_muon_moment2_method": "normuon"},
    "soap": {"optimizer": "soap"},
    "soap megatron order": {"optimizer": "soap", "soap_basis": "current"},
}


def _batched_config(name: str, ns_dtype: str):
    from megatron_mfsdp.optim.adaptive_muon import AdaptiveMuonSettings
    from megatron_mfsdp.optim.soap import SoapSettings
    from megatron_mfsdp.testing import optimizer_config

    overrides = dict(BATCHED_RULES[name])
    method = overrides.pop("adaptive_muon_moment2_method", "adamuon")
    basis = overrides.pop("soap_basis", SoapSettings().soap_basis)
    settings = {"adaptive_muon": AdaptiveMuonSettings(method), "soap": SoapSettings(soap_basis=basis)}
    return optimizer_config(
        **overrides,
        muon_ns_dtype=ns_dtype,
        muon_coefficient_type="quintic",
        muon_ns_algorithm="auto",
        rule_settings=settings,
        lr=1e-3,
    )


def _batched_pieces(rule, config, count: int, shape, device: str, seed: int = 0):
    from megatron_mfsdp.optim.rule import OwnedPiece

    g = torch.Generator().manual_seed(seed)
    pieces = []
    for i in range(count):
        master = (torch.randn(shape, generator=g) * 0.02).to(device)
        grad = (torch.randn(shape, generator=g) * 1e-3).to(device)
        piece = OwnedPiece(f"e{i}", f"e{i}", rule.name, master.numel(), 0, master, grad, param_shape=tuple(shape))
        piece.state = rule.init_state(piece, rule.settings_in(config))
        pieces.append(piece)
    return pieces


def _timed_steps(rule, config, pieces, batched: bool, repeats: int) -> list[float]:
    from megatron_mfsdp.optim import matrix
    from megatron_mfsdp.optim.rule import StepContext

    device = pieces[0].master.device.type
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    matrix.FORCE_BATCHED = batched
    try:
        times = []
        for step in range(1, repeats + 2):  # step 1 untimed (SOAP's eigh, first-touch allocations)
            ctx = StepContext(config, step, config.lr, 0.1, settings=rule.settings_in(config))
            sync()
            t0 = time.perf_counter()
            rule.step(pieces, ctx)
            sync()
            if step > 1:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        matrix.FORCE_BATCHED = None


def run_batched(args) -> list[dict]:
    """Every rule with a batched hook: ``count`` same-shape matrices on one owner, batched against the loop."""
    out = []
    for name in args.batched_rules or BATCHED_RULES:
        config = _batched_config(name, args.ns_dtype)
        rule = registry.optimizer_rule(config.optimizer)
        runs = {}
        for batched in (False, True):
            pieces = _batched_pieces(rule, config, args.batched_count, tuple(args.batched_shape), args.device)
            start = [p.master.clone() for p in pieces]
            runs[batched] = (
                statistics.median(_timed_steps(rule, config, pieces, batched, args.batched_repeats)),
                pieces,
            )
        loop, stacked = runs[False][1], runs[True][1]
        moved = max((p.master - s).abs().max().item() for p, s in zip(loop, start))
        diff = max((a.master - b.master).abs().max().item() for a, b in zip(loop, stacked))
        steps = torch.stack([p.master - s for p, s in zip(loop, start)])
        relative = (
            torch.stack([b.master for b in stacked]) - torch.stack([a.master for a in loop])
        ).norm() / steps.norm()
        bitwise = all(
            torch.equal(a.master, b.master) and all(torch.equal(a.state[k], b.state[k]) for k in a.state)
            for a, b in zip(loop, stacked)
        )
        out.append(
            dict(
                relative=relative.item(),
                rule=name,
                loop_ms=runs[False][0] * 1e3,
                batched_ms=runs[True][0] * 1e3,
                diff=diff,
                moved=moved,
                bitwise=bitwise,
            )
        )
    shape = "x".join(map(str, args.batched_shape))
    print(
        f"\n=== batched directions: {args.batched_count} matrices of {shape} on one owner ({args.device}), "
        f"{torch.get_num_threads()} thread(s), Newton-Schulz {args.ns_dtype}, "
        f"median of {args.batched_repeats} steps ==="
    )
    print(
        f"{'rule':<24} {'loop ms':>10} {'batched ms':>11} {'loop/batched':>13} {'max |diff|':>11} "
        f"{'/ max step':>11} {'rel. update':>11} bitwise"
    )
    for r in out:
        print(
            f"{r['rule']:<24} {r['loop_ms']:>10.1f} {r['batched_ms']:>11.1f} {r['loop_ms'] / r['batched_ms']:>13.2f} "
            f"{r['diff']:>11.2e} {r['diff'] / r['moved']:>11.2e} {r['relative']:>11.2e} "
            f"{'yes' if r['bitwise'] else 'no'}"
        )
    for r in out:
        print(
            f"BATCHED rule={r['rule'].replace(' ', ':')} device={args.device} count={args.batched_count} shape={shape} "
            f"loop_ms={r['loop_ms']:.2f} batched_ms={r['batched_ms']:.2f} "
            f"loop_over_batched={r['loop_ms'] / r['batched_ms']:.3f} max_diff={r['diff']:.3e} "
            f"diff_over_step={r['diff'] / r['moved']:.3e} update_relative_diff={r['relative']:.3e} "
            f"bitwise={r['bitwise']}"
        )
    sys.stdout.flush()
    return out


# --------------------------------------------------------------------------- gradient statistics
def run_grad_norm(args) -> None:
    """--grad-norm: the shell's sum of squares (fp32 row norms summed in fp64) against casting to fp64 first
    and against one fp32 norm, on a 4M-element fp32 gradient: ms each and relative error to fp64."""
    from megatron_mfsdp.optim.optimizer import sum_of_squares

    t = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0))
    ways = {
        "row_norms": lambda: sum_of_squares(t),  # ours
        "cast_to_fp64": lambda: t.double().square().sum(),
        "one_fp32_norm": lambda: torch.linalg.vector_norm(t).double().square(),
    }
    exact = t.double().square().sum().item()
    print(f"\n=== gradient sum of squares, {t.numel():,} fp32 elements, {torch.get_num_threads()} thread(s) ===")
    for name, fn in ways.items():
        fn()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            value = fn().item()
            times.append(time.perf_counter() - t0)
        ms, error = statistics.median(times) * 1e3, abs(value - exact) / exact
        print(f"GRADNORM way={name} ms={ms:.2f} relative_error={error:.1e}")


# --------------------------------------------------------------------------- printing
def _mb(b):
    return f"{b / 2**20:8.2f} MiB"


def print_world(r, args):
    W, s = r["W"], r["stats"]
    print(
        f"\n--- W={W} results (step time = slowest rank; {args.iters} timed iterations after {args.warmup} warm-up) ---"
    )
    print(
        f"{'method':<11} {'median ms':>10} {'min ms':>9} {'x ours':>7} {'bytes/rank (max)':>17} "
        f"{'coll./step':>10}  collectives (count, elements)"
    )
    for m in METHODS:
        n, by_name = r["collectives"][m]
        detail = ", ".join(f"{k} x{c} ({e:,} el)" for k, (c, e) in sorted(by_name.items())) or "-"
        ratio = s[m]["median"] / s["ours"]["median"]
        print(
            f"{m:<11} {s[m]['median']:>10.1f} {s[m]['min']:>9.1f} {ratio:>7.2f} {_mb(r['bytes_max'][m]):>17} "
            f"{n:>10}  {detail}"
        )
    print(
        "per-rank median ms: "
        + "; ".join(f"{m} " + "/".join(f"{v:.1f}" for v in s[m]["per_rank_median"]) for m in METHODS)
    )
    print(
        "ours bytes per rank: "
        + ", ".join(_mb(b).strip() for b in r["bytes_ours_per_rank"])
        + f"  (rank 0: {r['ours_bytes_detail_rank0']})"
    )
    print(f"recon transient all-gather buffer (largest matrix): {_mb(r['recon_gather_buffer_max_bytes']).strip()}")
    b = r["breakdown"]
    print(
        f"ours breakdown (max over ranks, median): grad stats + all-reduce {b['stats']:.2f} ms, "
        f"local updates {b['update']:.1f} ms; bare NS loop owned {b['ns_owned']:.1f} ms vs all matrices "
        f"{b['ns_all']:.1f} ms (= {b['ns_all'] / max(b['ns_owned'], 1e-9):.2f}x)"
    )
    n = r["norms"]
    print(
        f"check: grad norm ours {n['ours']:.6e} recon {n['recon']:.6e} replicated {n['replicated']:.6e}; "
        f"max |param - replicated| after all steps: ours {r['diff_ours']:.3e}, recon {r['diff_recon']:.3e}"
    )
    sys.stdout.flush()


def result_line(r):
    s = r["stats"]
    o = s["ours"]["median"]
    return (
        f"RESULT W={r['W']} ours_ms={o:.2f} recon_ms={s['recon']['median']:.2f} "
        f"replicated_ms={s['replicated']['median']:.2f} recon_over_ours={s['recon']['median'] / o:.3f} "
        f"replicated_over_ours={s['replicated']['median'] / o:.3f} "
        f"ours_min_ms={s['ours']['min']:.2f} recon_min_ms={s['recon']['min']:.2f} "
        f"replicated_min_ms={s['replicated']['min']:.2f} "
        f"ours_bytes={r['bytes_max']['ours']} recon_bytes={r['bytes_max']['recon']} "
        f"replicated_bytes={r['bytes_max']['replicated']} "
        f"ours_collectives={r['collectives']['ours'][0]} recon_collectives={r['collectives']['recon'][0]} "
        f"replicated_collectives={r['collectives']['replicated'][0]}"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--ffn-hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--ns-dtype",
        choices=sorted(NS_DTYPES),
        default="fp32",
        help="Newton-Schulz dtype (bf16 matmuls are very slow on most CPUs)",
    )
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--coefficients", default="simple", choices=sorted(NS_COEFFICIENTS), help="--muon-coefficient-type")
    p.add_argument(
        "--no-split-qkv",
        dest="split_qkv",
        action="store_false",
        help="orthogonalize linear_qkv as one matrix instead of Q, K, V blocks",
    )
    p.add_argument("--planner", default="auto", choices=POLICIES)
    p.add_argument(
        "--recon-prefetch",
        action="store_true",
        help="reconstruction baseline: issue the next matrix's all-gather asynchronously "
        "while Newton-Schulz runs (default: one blocking all-gather per matrix)",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores to share: each rank uses max(1, cpus // W) threads",
    )
    p.add_argument(
        "--rules",
        nargs="*",
        default=None,
        help="--optimizer values to time owner vs --mfsdp-layout even (default: every one registered; none: skip)",
    )
    p.add_argument("--skip-muon-baselines", action="store_true", help="only the per-rule owner vs even table")
    p.add_argument("--batched", action="store_true", help="only the batched-directions table (one process)")
    p.add_argument("--grad-norm", action="store_true", help="only the gradient sum-of-squares timings (one process)")
    p.add_argument("--batched-count", type=int, default=64, help="same-shape matrices on the owner")
    p.add_argument("--batched-shape", type=int, nargs=2, default=[512, 1408], metavar=("ROWS", "COLS"))
    p.add_argument("--batched-repeats", type=int, default=3, help="timed steps each way (after an untimed one)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="--batched: where the matrices live")
    p.add_argument("--batched-rules", nargs="*", choices=list(BATCHED_RULES), help="--batched: these rows only")
    p.add_argument("--moe", action="store_true", help="only the MoE table: owner vs even vs layer-wise, both domains")
    p.add_argument("--moe-world-size", type=int, default=4)
    p.add_argument("--moe-ep", type=int, default=2, help="--moe: --expert-model-parallel-size")
    p.add_argument("--moe-experts", type=int, default=8, help="--moe: --num-experts")
    p.add_argument("--moe-topk", type=int, default=2, help="--moe: --moe-router-topk")
    p.add_argument("--moe-ffn-hidden-size", type=int, default=512, help="--moe: --moe-ffn-hidden-size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    p.add_argument("--quick", action="store_true", help="tiny config for a CI smoke run (< 60 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_layers, args.hidden_size, args.ffn_hidden_size = 2, 64, 256
        args.num_attention_heads, args.num_query_groups = 4, 2
        args.vocab_size, args.seq_length, args.micro_batch_size = 128, 32, 2
        args.iters, args.warmup = 3, 1
    if args.rules is None:
        args.rules = registry.optimizer_choices()
    unknown = sorted(set(args.rules) - set(registry.optimizer_choices()))
    if unknown:
        p.error(f"--rules {' '.join(unknown)}: not an --optimizer value ({', '.join(registry.optimizer_choices())})")
    if args.iters < 1 or args.warmup < 1:
        p.error("--iters and --warmup must be >= 1 (the first warm-up step counts collectives)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.batched or args.grad_norm:
        torch.set_num_threads(args.cpus)
        run_batched(args) if args.batched else run_grad_norm(args)
        return
    worker_args = {
        k: getattr(args, k)
        for k in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "vocab_size",
            "seq_length",
            "micro_batch_size",
            "iters",
            "warmup",
            "ns_dtype",
            "ns_steps",
            "coefficients",
            "split_qkv",
            "planner",
            "recon_prefetch",
            "seed",
        )
    }
    print(
        f"bench_optimizer_step: GPT layers={args.num_layers} hidden={args.hidden_size} "
        f"ffn={args.ffn_hidden_size} heads={args.num_attention_heads} groups={args.num_query_groups} "
        f"vocab={args.vocab_size} seq={args.seq_length}; torch {torch.__version__}, gloo, {args.cpus} cpus; "
        f"recon all-gather {'prefetched (async)' if args.recon_prefetch else 'blocking, one per matrix'}; "
        f"all three include the AdamW tail and a global grad norm"
    )
    sys.stdout.flush()
    if args.moe:
        run_moe(args, worker_args)
        return
    if not args.skip_muon_baselines:
        muon_baselines(args, worker_args)
    run_rules(args, worker_args)


def muon_baselines(args, worker_args) -> None:
    results = []
    for W in args.world_sizes:
        threads = max(1, args.cpus // W)
        r = spawn(W, threads, _worker, worker_args, timeout=args.timeout)
        print_world(r, args)
        results.append(r)

    print("\n=== summary (median step ms, slowest rank) ===")
    print(
        f"{'W':>3} {'ours':>9} {'recon':>9} {'replicated':>11} {'recon/ours':>11} {'repl/ours':>10} "
        f"{'ours MiB':>9} {'recon MiB':>10} {'repl MiB':>9} {'coll ours/recon/repl':>21}"
    )
    for r in results:
        s = r["stats"]
        o = s["ours"]["median"]
        c = "/".join(str(r["collectives"][m][0]) for m in METHODS)
        print(
            f"{r['W']:>3} {o:>9.1f} {s['recon']['median']:>9.1f} {s['replicated']['median']:>11.1f} "
            f"{s['recon']['median'] / o:>11.2f} {s['replicated']['median'] / o:>10.2f} "
            f"{r['bytes_max']['ours'] / 2**20:>9.2f} {r['bytes_max']['recon'] / 2**20:>10.2f} "
            f"{r['bytes_max']['replicated'] / 2**20:>9.2f} {c:>21}"
        )
    for r in results:
        print(result_line(r))


if __name__ == "__main__":
    main()
