"""A calibrated scaling model: optimizer-step and iteration time of MatrixFSDP ("ours") against
reconstruction Muon (ZeRO-3 even shards) from 8 to 1024 GPUs, without launching a GPU.

ours    every Muon matrix whole on one owner (the library's own planner decides who): the step is
        owner-local Newton-Schulz plus the AdamW tail, no tensor collective; forward and backward
        gather each unit from its owners (one broadcast per non-empty owner part, so up to
        #matrix owners + W calls per unit: the owner fan-out), the reduction is two
        all_to_all_single per unit (today: blocking inside the backward hook).
recon   ZeRO-3 even flat shards (FSDP2-style): per matrix and step, all-gather the full fp32
        direction, Newton-Schulz on every rank, keep the slice; forward/backward use one
        all-gather and one reduce-scatter per unit, overlapped with compute.

Times are alpha-beta: a collective costs host overhead + NCCL-style latency (a base plus one
hop latency per ring step, constants from NCCL's own tuning model) + bytes / bus bandwidth;
a matrix product costs a launch plus flops / throughput; elementwise work costs a launch per
op plus bytes / memory bandwidth. Every constant below is named and commented. The same
formulas, with this machine's calibrated figures (timed matmuls, a timed gloo all-gather and
broadcast on 2 processes), predict benchmarks/bench_optimizer_step.py --quick, which is run
as a subprocess and compared.

    .venv/bin/python benchmarks/scaling_model.py            # calibrate, validate (~2-4 min), tables, plot
    .venv/bin/python benchmarks/scaling_model.py --quick    # CI smoke: short calibration, no validation run
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from megatron_mfsdp.optim.muon import NewtonSchulzCost, newton_schulz_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- assumptions
# The paper's cluster: A100-80GB, 8 per node (MatrixFSDP, arXiv 2607.05895, Section "Setup").
A100_BF16_PEAK = 312e12  # NVIDIA A100 datasheet: dense bf16 tensor-core peak, flop/s
NS_MATMUL_EFFICIENCY = 0.70  # assumed: cuBLAS bf16 GEMMs with all dims >= 1024 reach ~70% of peak
FWD_BWD_MFU = 0.50  # assumed model-flops utilization of GPT forward/backward at seq 4096
A100_HBM_BW = 2.0e12 * 0.8  # A100-80GB datasheet 2.0 TB/s; assumed 80% reached by elementwise kernels
GPU_LAUNCH_S = 5e-6  # assumed: host + launch cost of one CUDA kernel (matmul or elementwise op)
GPU_CALL_OVERHEAD_S = 10e-6  # assumed: host cost of one torch.distributed call (Python + NCCL enqueue)
GPUS_PER_NODE = 8
# NCCL's own latency/bandwidth model (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel): ring/LL
# base latency 3.6 us, hop latency NVLink 0.47 us and network 2.7 us (intra-node hops x1.8 when the
# ring spans nodes); sm80 bus bandwidth clamped at 235 GB/s. A broadcast costs base + nRanks hops.
NCCL_BASE_LAT_S = 3.6e-6
NVLINK_HOP_S = 0.47e-6
NET_HOP_S = 2.7e-6
NVLINK_BUS_BW = 230e9  # assumed, just under NCCL's 235 GB/s clamp for A100 (DGX A100, NVSwitch)
IB_BUS_BW = 23e9  # assumed: 8x HDR 200 Gb/s per node = 25 GB/s per GPU, 92% reached by NCCL rings
A2A_PEER_LAT_S = 1.0e-6  # assumed: per-peer cost of NCCL's grouped send/recv in an all-to-all
# Training settings (the paper's: hidden 4096, FFN 16384, seq 4096, bf16, activation checkpointing).
TOKENS_PER_GPU = 4096  # assumed: one 4096-token sequence per data-parallel rank and iteration
MICRO_BATCHES = 1  # assumed: no gradient accumulation (the step is paid once per micro-batch)
ACT_CKPT_PASSES = 4  # forward + recomputed forward + backward (2x): 4 forward-equivalents of flops
NS_STEPS = 5  # Newton-Schulz iterations (Megatron-LM's --muon-num-ns-steps default)
GPU_NS = NewtonSchulzCost(NS_STEPS, "bf16", "auto")  # on CUDA: bf16, so the standard iteration
CPU_NS = NewtonSchulzCost(NS_STEPS, "fp32", "auto", on_cpu=True)  # bench_optimizer_step.py's: Gram, symmetric products
PARAM_BYTES = 2  # bf16 parameters: the bytes of a forward/backward gather
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduction (MatrixFSDPConfig grad_reduce_in_fp32 default)
RECON_GATHER_BYTES = 4  # reconstruction gathers the fp32 Nesterov direction (testing/baselines.py)
OURS_REDUCTION_OVERLAPPED = False  # today's runtime waits on the reduction inside the hook (design.md)
RECON_GATHER_PREFETCHED = False  # stock FSDP2 Muon: one blocking all-gather per matrix
# Elementwise work per element (fp32 reads + writes, counted from optim/muon.py and adamw.py).
MUON_ELEMENTWISE_BYTES = 64  # momentum lerp_, Nesterov lerp, casts/norm/scale, weight decay, add
ADAMW_ELEMENTWISE_BYTES = 80  # the 8 tensor ops of adamw_step_
# Kernel/op counts (from optim/muon.py: newton_schulz, muon_step_, adamw_step_).
NS_MATMULS_PER_STEP = 3  # x x^T, addmm(gram, gram, gram), addmm(x, poly, x)
NS_OPS_PER_BLOCK = 8  # float, to(dtype), transpose, norm, clamp, div, cast back, mul_(scale)
QKV_SPLIT_OPS = 8  # reshape/split into Q, K, V and merge back (cat)
MUON_OPS_PER_MATRIX = 4  # lerp_, lerp (Nesterov), mul_ (weight decay), add_
ADAMW_OPS_PER_PIECE = 8  # adamw_step_
STAT_OPS_PER_PIECE = 3  # grad statistics: double, square, sum
STEP_SHELL_OPS = 40  # assumed: Python work of an optimizer step outside the pieces (groups, casts, lr)
GLOO_OVERSUBSCRIBED_LATENCY = True  # CPU: gloo latency grows with ranks per core (time-sharing)

# The paper's published numbers (MatrixFSDP, arXiv 2607.05895, Table 2: optimizer step in ms,
# stock FSDP2 Muon -> MatrixFSDP; end-to-end speedup).
PAPER = {
    8: (3.2, 367.0, 87.0, 1.37),
    16: (6.4, 1285.0, 89.0, 1.75),
    32: (12.9, 3079.0, 91.0, 2.15),
    64: (25.8, 5064.0, 93.0, 2.01),
}


@dataclass(frozen=True)
class Link:
    name: str
    bus_bw: float  # bytes/s per GPU (NCCL bus bandwidth)
    hop_s: float  # latency per ring step


@dataclass(frozen=True)
class Hardware:
    name: str
    ns_flops: float  # Newton-Schulz matmul throughput, flop/s
    fwd_bwd_flops: float  # forward/backward throughput, flop/s
    mem_bw: float  # bytes/s for elementwise work
    mm_launch_s: float  # fixed cost of one matrix product
    op_s: float  # fixed cost of one elementwise op
    call_s: float  # host cost of one collective call
    base_lat_s: float  # base latency of one collective
    intra: Link
    inter: Link
    per_node: int  # data-parallel ranks of one group on one node
    slowdown: float = 1.0  # CPU time-sharing: ranks per core
    ns: NewtonSchulzCost = GPU_NS  # the Newton-Schulz run (dtype, so kernel) at these rates


A100 = Hardware(
    "A100 cluster (paper)",
    A100_BF16_PEAK * NS_MATMUL_EFFICIENCY,
    A100_BF16_PEAK * FWD_BWD_MFU,
    A100_HBM_BW,
    GPU_LAUNCH_S,
    GPU_LAUNCH_S,
    GPU_CALL_OVERHEAD_S,
    NCCL_BASE_LAT_S,
    Link("nvlink", NVLINK_BUS_BW, NVLINK_HOP_S),
    Link("ib", IB_BUS_BW, NET_HOP_S),
    GPUS_PER_NODE,
)
A100_TP8 = replace(A100, per_node=1)  # with TP8 filling a node, the ranks of one DP group sit on different nodes


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    vocab: int
    seq: int
    tp: int = 1
    swiglu: bool = False
    bias: bool = True
    learned_pos: bool = False
    tied: bool = True


def paper_gpt(gpus: int) -> Shape:
    """The paper's weak-scaling GPT: 2 layers per GPU (16 layers = 3.22B matrix parameters at 8 GPUs,
    the paper's 3.2B; 32/64/128 layers = 6.4/12.9/25.8B). MHA 32 heads, GELU MLP, biases; the
    vocabulary (32000, tied) is our assumption."""
    return Shape(f"GPT-{2 * gpus}L", 2 * gpus, 4096, 16384, 32, 32, 32000, 4096)


LLAMA70B_TP8 = Shape("Llama-70B TP8", 80, 8192, 28672, 64, 8, 128256, 4096, 8, True, False, False, False)


# ----------------------------------------------------------------------------- the library's plan
def unit_specs_for(shape: Shape, ns: NewtonSchulzCost = GPU_NS):
    """UnitSpecs of a megatron-core GPT of this shape (TP-local), classified and costed by the library
    (runtime.wrapper.unit_specs with the GPT adapter's rules), from meta tensors: nothing allocated."""
    from megatron_mfsdp import MatrixFSDPConfig
    from megatron_mfsdp.models.adapter import ModelUnit
    from megatron_mfsdp.models.gpt import GPT_ADAPTER
    from megatron_mfsdp.runtime.wrapper import unit_specs

    s, t = shape, shape.tp
    kv = s.hidden // s.heads

    def par(name, *dims):
        return name, torch.nn.Parameter(torch.empty(*dims, device="meta"), requires_grad=False)

    def biased(name, rows, cols):
        return [par(f"{name}.weight", rows, cols)] + ([par(f"{name}.bias", rows)] if s.bias else [])

    def norm(name):
        return [par(f"{name}.weight", s.hidden)] + ([par(f"{name}.bias", s.hidden)] if s.bias else [])

    emb = [par("embedding.word_embeddings.weight", s.vocab // t, s.hidden)]
    if s.learned_pos:
        emb.append(par("embedding.position_embeddings.weight", s.seq, s.hidden))
    units = [ModelUnit("embedding", emb, [])]
    for i in range(s.layers):
        p = f"decoder.layers.{i}"
        params = norm(f"{p}.input_layernorm")
        params += biased(f"{p}.self_attention.linear_qkv", (s.heads + 2 * s.groups) * kv // t, s.hidden)
        params += [par(f"{p}.self_attention.linear_proj.weight", s.hidden, s.heads * kv // t)]
        params += [par(f"{p}.self_attention.linear_proj.bias", s.hidden)] if s.bias else []
        params += norm(f"{p}.pre_mlp_layernorm")
        params += biased(f"{p}.mlp.linear_fc1", (2 if s.swiglu else 1) * s.ffn // t, s.hidden)
        params += [par(f"{p}.mlp.linear_fc2.weight", s.hidden, s.ffn // t)]
        params += [par(f"{p}.mlp.linear_fc2.bias", s.hidden)] if s.bias else []
        units.append(ModelUnit(f"layer{i}", params, []))
    final = norm("decoder.final_layernorm")
    if not s.tied:
        final.append(par("output_layer.weight", s.vocab // t, s.hidden))
    units.append(ModelUnit("final", final, []))
    config = SimpleNamespace(num_attention_heads=s.heads, num_query_groups=s.groups, kv_channels=kv)
    return unit_specs(units, MatrixFSDPConfig(newton_schulz=ns), GPT_ADAPTER, config)


def ns_flops(shape, split_rows, ns: NewtonSchulzCost = GPU_NS) -> int:
    """Flops of orthogonalizing one matrix (per Q/K/V block when split) with the kernel the optimizer
    picks for ``ns``: the planner's own count (optim/muon.py, checked against torch's flop counter
    in tests/unit/test_muon_gram.py), 2 flops per multiply-add."""
    return 2 * newton_schulz_cost(shape, split_rows, ns)


@dataclass
class PlanStats:
    """What the model needs of one plan: per rank and per unit."""

    world: int
    ns_flops: list[int]  # true Newton-Schulz flops per rank and step
    matrices: list[list[tuple]]  # per rank: (shape, split_rows) of owned matrices
    tail: list[int]  # tail elements per rank
    tail_pieces: list[int]  # tail pieces per rank
    unit_numel: list[int]
    unit_segments: list[list[int]]  # [unit][rank]
    unit_calls: list[int]  # non-empty owner parts per unit (broadcasts of a gather)
    all_matrices: list[tuple]  # (shape, split_rows, numel) of every matrix
    all_tail: list[int]  # numel of every tail tensor
    planner_balance: str


def plan_stats(specs, world: int, ns: NewtonSchulzCost = GPU_NS) -> PlanStats:
    from megatron_mfsdp.placement import WHOLE, plan_units

    plan = plan_units(specs, world, "auto")
    flops, mats = [0] * world, [[] for _ in range(world)]
    tail, tail_pieces = [0] * world, [0] * world
    for unit in plan.units:
        for slot in unit.slots:
            if slot.owner >= 0:
                flops[slot.owner] += ns_flops(slot.shape, slot.split_rows, ns)
                mats[slot.owner].append((slot.shape, slot.split_rows))
        for r in range(world):
            for piece in unit.local_pieces(r):
                if piece.slot.storage != WHOLE:
                    tail[r] += piece.numel
                    tail_pieces[r] += 1
    segs = [[u.segment_numel(r) for r in range(world)] for u in plan.units]
    calls = [
        sum(u.matrix_bounds[r + 1] > u.matrix_bounds[r] for r in range(world))
        + sum(u.tail_bounds[r + 1] > u.tail_bounds[r] for r in range(world))
        for u in plan.units
    ]
    all_m = [(p.shape, p.split_rows, p.numel) for u in specs for p in u.params if p.storage == WHOLE]
    all_t = [p.numel for u in specs for p in u.params if p.storage != WHOLE]
    report = plan.report().splitlines()[-1]
    return PlanStats(
        world, flops, mats, tail, tail_pieces, [u.numel for u in plan.units], segs, calls, all_m, all_t, report
    )


# ----------------------------------------------------------------------------- cost formulas
def _nodes(hw: Hardware, group: int) -> int:
    return max(1, math.ceil(group / hw.per_node))


def _link(hw: Hardware, group: int) -> Link:
    return hw.inter if _nodes(hw, group) > 1 else hw.intra


def ring_latency(hw: Hardware, group: int, steps: int) -> float:
    """NCCL ring latency: base + intra hops (x1.8 when spanning nodes) + network hops."""
    nodes = _nodes(hw, group)
    inter = min(steps, nodes - 1) if nodes > 1 else 0
    intra_hop = hw.intra.hop_s * (1.8 if nodes > 1 else 1.0)
    return hw.call_s + hw.base_lat_s + (steps - inter) * intra_hop + inter * hw.inter.hop_s


def broadcast(hw: Hardware, group: int, nbytes: float) -> tuple[float, float]:
    """(latency, bandwidth) of one ring broadcast: nRanks hops (tuning.cc), bytes / bus bandwidth."""
    link = _link(hw, group)
    return hw.call_s + hw.base_lat_s + group * link.hop_s, nbytes / link.bus_bw


def all_gather(hw: Hardware, group: int, total_bytes: float) -> float:
    if group == 1:
        return 0.0
    return ring_latency(hw, group, group - 1) + total_bytes * (group - 1) / group / _link(hw, group).bus_bw


def all_reduce(hw: Hardware, group: int, nbytes: float) -> float:
    if group == 1:
        return 0.0
    return ring_latency(hw, group, 2 * (group - 1)) + 2 * nbytes * (group - 1) / group / _link(hw, group).bus_bw


def all_to_all(hw: Hardware, group: int, send: float, recv: float) -> float:
    """Uneven all-to-all; the busiest direction of a rank bounds it. Peers on the same node are
    reached over NVLink, the rest over the network."""
    if group == 1:
        return 0.0
    local = min(group, hw.per_node) - 1
    remote = (group - 1 - local) / (group - 1)
    worst = max(send, recv)
    bw_time = max(worst * (1 - remote) / hw.intra.bus_bw, worst * remote / hw.inter.bus_bw)
    return hw.call_s + hw.base_lat_s + (group - 1) * A2A_PEER_LAT_S + bw_time


def matmul_time(hw: Hardware, shape, split_rows) -> float:
    blocks = 1 if not split_rows else 3
    launches = blocks * NS_STEPS * NS_MATMULS_PER_STEP
    return hw.slowdown * (launches * hw.mm_launch_s + ns_flops(shape, split_rows, hw.ns) / hw.ns_flops)


def muon_matrix_time(hw: Hardware, shape, split_rows, numel: int) -> float:
    """Newton-Schulz plus the elementwise work of one Muon matrix on one rank."""
    blocks = 1 if not split_rows else 3
    ops = MUON_OPS_PER_MATRIX + blocks * NS_OPS_PER_BLOCK + (QKV_SPLIT_OPS if split_rows else 0)
    elementwise = ops * hw.op_s + numel * MUON_ELEMENTWISE_BYTES / hw.mem_bw
    return matmul_time(hw, shape, split_rows) + hw.slowdown * elementwise


def tail_time(hw: Hardware, elements: int, pieces: int) -> float:
    ops = pieces * (ADAMW_OPS_PER_PIECE + STAT_OPS_PER_PIECE)
    return hw.slowdown * (ops * hw.op_s + elements * ADAMW_ELEMENTWISE_BYTES / hw.mem_bw)


def step_ours(hw: Hardware, ps: PlanStats, all_ranks: int) -> float:
    """Owner-local step: the slowest rank's matrices and tail, plus one 2-scalar all-reduce."""
    per_rank = []
    for r in range(ps.world):
        mats = sum(muon_matrix_time(hw, s, q, s[0] * s[1]) for s, q in ps.matrices[r])
        stats = hw.slowdown * len(ps.matrices[r]) * STAT_OPS_PER_PIECE * hw.op_s
        per_rank.append(mats + stats + tail_time(hw, ps.tail[r], ps.tail_pieces[r]))
    shell = hw.slowdown * STEP_SHELL_OPS * hw.op_s
    return max(per_rank) + shell + all_reduce(hw, all_ranks, 16)


def step_recon(hw: Hardware, ps: PlanStats) -> float:
    """Reconstruction: per matrix, gather the fp32 direction and orthogonalize it on every rank."""
    w, total = ps.world, 0.0
    for shape, split, numel in ps.all_matrices:
        shard = -(-numel // w)
        gather = all_gather(hw, w, shard * w * RECON_GATHER_BYTES)
        ns = matmul_time(hw, shape, split)
        blocks = 1 if not split else 3
        ops = 2 + 2 + STAT_OPS_PER_PIECE + blocks * NS_OPS_PER_BLOCK + (QKV_SPLIT_OPS if split else 0)
        local = hw.slowdown * (ops * hw.op_s + shard * MUON_ELEMENTWISE_BYTES / hw.mem_bw)
        total += (max(gather, ns) if RECON_GATHER_PREFETCHED else gather + ns) + local
    tail = sum(-(-n // w) for n in ps.all_tail)
    shell = hw.slowdown * STEP_SHELL_OPS * hw.op_s
    return total + tail_time(hw, tail, len(ps.all_tail)) + shell + all_reduce(hw, w, 8)


@dataclass
class UnitTimes:
    compute_fwd: float
    compute_bwd: float
    gather_lat: float  # ours: sum of the per-owner broadcast latencies
    gather_bw: float
    reduce: float  # ours today: owner all-to-alls (+ replica all-reduce)
    reduce_ring: float  # ours with one pipelined ring reduce per owner part (what coalescing could use)
    zero3_gather: float
    zero3_reduce: float


def unit_times(hw: Hardware, shape: Shape, ps: PlanStats, u: int, replicas: int = 1) -> UnitTimes:
    s, w, numel = shape, ps.world, ps.unit_numel[u]
    flops = 2 * numel * TOKENS_PER_GPU
    if ps.unit_numel[u] and 0 < u < len(ps.unit_numel) - 1:  # a transformer layer: add attention
        flops += 4 * TOKENS_PER_GPU**2 * s.hidden // s.tp
    tp_comm = 0.0
    if s.tp > 1 and 0 < u < len(ps.unit_numel) - 1:  # 2 TP all-reduces of the activations per pass
        tp_comm = 2 * all_reduce(replace(hw, per_node=GPUS_PER_NODE), s.tp, TOKENS_PER_GPU * s.hidden * PARAM_BYTES)
    fwd = flops / hw.fwd_bwd_flops + tp_comm
    bwd = (ACT_CKPT_PASSES - 1) * fwd
    lat, bw = broadcast(hw, w, 0)
    gather_lat = ps.unit_calls[u] * lat
    gather_bw = broadcast(hw, w, numel * PARAM_BYTES)[1] if w > 1 else 0.0
    segs = ps.unit_segments[u]
    reduce = 0.0
    if w > 1:
        worst = max(range(w), key=lambda r: max(numel - segs[r], (w - 1) * segs[r]))
        for frac in (0.5, 0.5):  # two calls (matrix region, tail region); bytes split between them
            send, recv = numel - segs[worst], (w - 1) * segs[worst]
            reduce += all_to_all(hw, w, frac * send * GRAD_REDUCE_BYTES, frac * recv * GRAD_REDUCE_BYTES)
    reduce_ring = 0.0 if w == 1 else ps.unit_calls[u] * lat + numel * GRAD_REDUCE_BYTES / _link(hw, w).bus_bw
    if replicas > 1:
        rep_hw = replace(hw, per_node=1)  # replicas of a segment sit on different nodes
        extra = all_reduce(rep_hw, replicas, max(segs) * GRAD_REDUCE_BYTES)
        reduce, reduce_ring = reduce + extra, reduce_ring + extra
    full = w * replicas
    zg = all_gather(hw, full, numel * PARAM_BYTES)
    zr = all_gather(hw, full, numel * GRAD_REDUCE_BYTES)  # a reduce-scatter moves what an all-gather does
    return UnitTimes(fwd, bwd, gather_lat, gather_bw, reduce, reduce_ring, zg, zr)


def iteration(hw: Hardware, shape: Shape, ps: PlanStats, replicas: int = 1, variant: str = "today"):
    """(ours, recon) forward+backward time per micro-batch, before the step. variant: 'today'
    (all-to-all reduction, blocking unless OURS_REDUCTION_OVERLAPPED), 'overlap' (issue 11 item 1),
    'ring' (overlapped, and one ring reduce per owner part instead of the all-to-all)."""
    overlap = variant != "today" or OURS_REDUCTION_OVERLAPPED
    ours = recon = 0.0
    for u in range(len(ps.unit_numel)):
        t = unit_times(hw, shape, ps, u, replicas)
        g, red = t.gather_lat + t.gather_bw, (t.reduce_ring if variant == "ring" else t.reduce)
        ours += max(t.compute_fwd, g)
        ours += max(t.compute_bwd, g + red) if overlap else max(t.compute_bwd, g) + red
        recon += max(t.compute_fwd, t.zero3_gather) + max(t.compute_bwd, t.zero3_gather + t.zero3_reduce)
    return ours, recon


# ----------------------------------------------------------------------------- calibration (this machine)
def _timeit(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gloo_worker(rank, world, sizes, reps):
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.ones(n)
        full = torch.empty(n * world)
        dist.barrier()
        out[("all_gather", n)] = _timeit(lambda x=x, full=full: dist.all_gather_into_tensor(full, x), reps)
        y = torch.ones(n * world)
        dist.barrier()
        out[("broadcast", n)] = _timeit(lambda y=y: dist.broadcast(y, src=0), reps)
    return out


def calibrate(reps: int) -> dict:
    """Timed matmuls (1 thread, fp32) and gloo collectives on 2 processes."""
    from megatron_mfsdp.testing import run_workers

    torch.set_num_threads(1)
    mm = {}
    for m, k, n in ((64, 64, 64), (256, 256, 256), (512, 512, 1024)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        mm[(m, k, n)] = _timeit(lambda a=a, b=b: a @ b, reps)
    (s, t_small), (l1, t1), (l2, t2) = [(2 * m * k * n, t) for (m, k, n), t in mm.items()]
    rate = (l2 - l1) / max(t2 - t1, 1e-9)
    mm_launch = max(t_small - s / rate, 1e-7)
    x, y = torch.ones(64), torch.ones(64)
    op = _timeit(lambda: x.add_(y), reps * 10)
    big = torch.ones(4_000_000)
    mem_bw = 3 * 4 * big.numel() / _timeit(lambda: big.add_(big), max(3, reps // 4))
    small, large = 16, 1 << 20
    g = run_workers(2, _gloo_worker, (small, large), reps, threads=1, timeout=300, fresh=True)[0]
    lat = {k: g[(k, small)] for k in ("all_gather", "broadcast")}
    bw = {k: large * 4 / max(g[(k, large)] - g[(k, small)], 1e-9) for k in ("all_gather", "broadcast")}
    return dict(rate=rate, mm_launch=mm_launch, op=op, mem_bw=mem_bw, lat=lat, bw=bw, mm=mm)


def cpu_hardware(cal: dict, world: int, cores: int) -> Hardware:
    """This machine as a Hardware: one link (gloo over loopback), one 'node' holding every rank.
    A gloo ring step costs the measured 2-process latency (minus the call) per hop."""
    slowdown = max(1.0, world / cores)  # bench_optimizer_step.py gives each rank max(1, cores // W) threads
    hop = cal["lat"]["all_gather"] * (slowdown if GLOO_OVERSUBSCRIBED_LATENCY else 1.0)
    gloo = Link("gloo", cal["bw"]["all_gather"] / slowdown, hop)
    return Hardware(
        "this machine (gloo)",
        cal["rate"],
        cal["rate"],
        cal["mem_bw"],
        cal["mm_launch"],
        cal["op"],
        0.0,
        0.0,
        gloo,
        gloo,
        world,
        slowdown,
        CPU_NS,
    )


QUICK_BENCH_SHAPE = Shape("bench --quick", 2, 64, 256, 4, 2, 128, 32, learned_pos=True)  # its --quick config


def validate(cal: dict, cores: int) -> list[tuple]:
    """Run bench_optimizer_step.py --quick and compare its RESULT lines with the prediction."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_optimizer_step.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise RuntimeError("bench_optimizer_step.py --quick failed:\n" + proc.stdout[-2000:] + proc.stderr[-2000:])
    measured = {
        int(m.group(1)): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"RESULT W=(\d+) ours_ms=([\d.]+) recon_ms=([\d.]+)", proc.stdout)
    }
    specs = unit_specs_for(QUICK_BENCH_SHAPE, CPU_NS)
    rows = []
    for w, (ours_ms, recon_ms) in sorted(measured.items()):
        hw, ps = cpu_hardware(cal, w, cores), plan_stats(specs, w, CPU_NS)
        rows.append((w, ours_ms, 1e3 * step_ours(hw, ps, w), recon_ms, 1e3 * step_recon(hw, ps)))
    return rows


# ----------------------------------------------------------------------------- studies
def fanout(hw: Hardware, shape: Shape, worlds, layer_unit: int = 1):
    """Per layer unit, ours' gather latency (owner fan-out) against its bandwidth term and compute."""
    specs = unit_specs_for(shape)
    rows = []
    for w in worlds:
        ps = plan_stats(specs, w)
        t = unit_times(hw, shape, ps, layer_unit)
        rows.append((w, t.gather_lat, t.gather_bw, t.compute_fwd, ps.unit_calls[layer_unit]))
    return rows


def first_w(rows, index: int):
    return next((w for w, lat, *rest in rows if lat > rest[index - 2]), None)


def series(hw: Hardware, shape_for, gpus_list, tp: int = 1, replicate: int = 1):
    """Per GPU count: (gpus, ours step, recon step, ours iteration today, overlapped, overlapped with ring
    reduces, recon iteration, plan stats); an iteration includes its step."""
    out = []
    for gpus in gpus_list:
        shape = shape_for(gpus)
        dp = gpus // tp
        ps = plan_stats(unit_specs_for(shape), dp // replicate)
        full = plan_stats(unit_specs_for(shape), dp) if replicate > 1 else ps
        so, sr = step_ours(hw, ps, dp), step_recon(hw, full)
        io, ir = iteration(hw, shape, ps, replicate)
        ioo, _ = iteration(hw, shape, ps, replicate, "overlap")
        iring, _ = iteration(hw, shape, ps, replicate, "ring")
        m = MICRO_BATCHES
        out.append((gpus, so, sr, m * io + so, m * ioo + so, m * iring + so, m * ir + sr, ps))
    return out


def print_assumptions():
    print("=== assumptions (named constants in benchmarks/scaling_model.py) ===")
    names = [k for k, v in globals().items() if k.isupper() and isinstance(v, (int, float, bool)) and k != "ROOT"]
    print(", ".join(f"{k}={globals()[k]:g}" for k in names))


def plot(path, paper_rows, llama_rows, hybrid_rows, fan_rows, fan_w):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.8))
    g = [r[0] for r in paper_rows]
    ax[0].plot(g, [1e3 * r[1] for r in paper_rows], "o-", label="ours (model)")
    ax[0].plot(g, [1e3 * r[2] for r in paper_rows], "s-", label="reconstruction (model)")
    pw = [w for w in g if w in PAPER]
    ax[0].plot(pw, [PAPER[w][2] for w in pw], "o--", label="MatrixFSDP (paper)")
    ax[0].plot(pw, [PAPER[w][1] for w in pw], "s--", label="FSDP2 Muon (paper)")
    ax[0].set(xscale="log", yscale="log", xlabel="GPUs (= W, 2 layers per GPU)", ylabel="optimizer step, ms")
    ax[0].set_title("paper GPT, weak scaling")
    g = [r[0] for r in llama_rows]
    ax[1].plot(g, [1e3 * r[1] for r in llama_rows], "o-", label="ours step")
    ax[1].plot(g, [1e3 * r[2] for r in llama_rows], "s-", label="recon step")
    ax[1].plot(g, [1e3 * r[3] for r in llama_rows], "^-", label="ours iteration")
    ax[1].plot(g, [1e3 * r[5] for r in llama_rows], "^:", label="ours iteration, ring reduce + overlap")
    ax[1].plot(g, [1e3 * r[6] for r in llama_rows], "v-", label="recon iteration")
    ax[1].plot([r[0] for r in hybrid_rows], [1e3 * r[3] for r in hybrid_rows], "x--", label="ours iteration, hybrid")
    ax[1].set(xscale="log", yscale="log", xlabel="GPUs (TP8 x DP W)", ylabel="ms", title="Llama-70B TP8")
    w = [r[0] for r in fan_rows]
    ax[2].plot(w, [1e3 * r[1] for r in fan_rows], "o-", label="gather latency (fan-out)")
    ax[2].plot(w, [1e3 * r[2] for r in fan_rows], "s-", label="gather bandwidth")
    ax[2].plot(w, [1e3 * r[3] for r in fan_rows], "^-", label="forward compute")
    if fan_w:
        ax[2].axvline(fan_w, color="gray", ls=":")
    ax[2].set(xscale="log", yscale="log", xlabel="W (data-parallel ranks)", ylabel="ms per layer unit")
    ax[2].set_title("GPT 25.8B: one layer's gather")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_calibration(cal):
    print("\n=== calibration: this machine (1 thread per rank, fp32; gloo on 2 processes) ===")
    for (m, k, n), t in cal["mm"].items():
        print(f"matmul {m}x{k} @ {k}x{n}: {1e6 * t:.1f} us")
    lat, bw = cal["lat"], cal["bw"]
    print(
        f"CALIB matmul_gflops={cal['rate'] / 1e9:.2f} mm_launch_us={1e6 * cal['mm_launch']:.2f} "
        f"op_us={1e6 * cal['op']:.2f} mem_gbps={cal['mem_bw'] / 1e9:.2f} "
        f"gloo_allgather_lat_us={1e6 * lat['all_gather']:.1f} gloo_bcast_lat_us={1e6 * lat['broadcast']:.1f} "
        f"gloo_allgather_gbps={bw['all_gather'] / 1e9:.3f} gloo_bcast_gbps={bw['broadcast'] / 1e9:.3f}"
    )


def print_validation(rows):
    print("\n=== validation: bench_optimizer_step.py --quick (measured, slowest rank, ms) vs this model ===")
    print(
        f"{'W':>3} {'ours meas':>10} {'pred':>8} {'pred/meas':>9} {'recon meas':>11} {'pred':>8} {'pred/meas':>9} "
        f"{'recon/ours meas':>16} {'pred':>6}"
    )
    for w, om, op_, rm, rp in rows:
        print(
            f"{w:>3} {om:>10.2f} {op_:>8.2f} {op_ / om:>9.2f} {rm:>11.2f} {rp:>8.2f} {rp / rm:>9.2f} "
            f"{rm / om:>16.2f} {rp / op_:>6.2f}"
        )
        print(f"VALID W={w} ours_meas_ms={om:.2f} ours_pred_ms={op_:.2f} recon_meas_ms={rm:.2f} recon_pred_ms={rp:.2f}")


def _pred_line(setting, row):
    gpus, so, sr, io, ioo, iring, ir, _ = row
    print(
        f"PRED setting={setting} gpus={gpus} ours_step_ms={1e3 * so:.3f} recon_step_ms={1e3 * sr:.3f} "
        f"ours_iter_ms={1e3 * io:.3f} ours_ring_iter_ms={1e3 * iring:.3f} recon_iter_ms={1e3 * ir:.3f}"
    )


def print_paper(rows):
    print(f"\n=== paper settings on {A100.name}: hidden 4096, FFN 16384, seq 4096, bf16, 2 layers per GPU ===")
    print(
        "step ms: model ours / recon (ratio) | paper FSDP2 Muon -> MatrixFSDP (ratio); iteration ms: ours today, "
        "+overlap, +ring reduce, recon; e2e = recon / ours today (ring) | paper e2e"
    )
    for row in rows:
        gpus, so, sr, io, ioo, iring, ir, ps = row
        params = (sum(n for _, _, n in ps.all_matrices) + sum(ps.all_tail)) / 1e9
        pub = PAPER.get(gpus)
        paper = f"{pub[1]:>5.0f} -> {pub[2]:<3.0f} ({pub[1] / pub[2]:>4.1f}x)" if pub else f"{'-':>19}"
        print(
            f"{gpus:>5} GPUs {params:>6.2f}B | {1e3 * so:>5.0f} / {1e3 * sr:>6.0f} ({sr / so:>5.1f}x) | {paper} | "
            f"{1e3 * io:>6.0f} {1e3 * ioo:>6.0f} {1e3 * iring:>6.0f} {1e3 * ir:>6.0f}  e2e {ir / io:>4.2f} "
            f"({ir / iring:>4.2f}) | {pub[3] if pub else '-'} | {ps.planner_balance}"
        )
        _pred_line("paper", row)
    ps = rows[0][-1]
    busiest = max(ps.ns_flops)
    need = busiest / (PAPER[rows[0][0]][2] / 1e3)
    print(
        f"note: the paper's {PAPER[rows[0][0]][2]:.0f} ms at {rows[0][0]} GPUs needs {need / 1e12:.0f} TFLOP/s for the "
        f"{busiest / 1e12:.1f} TFLOP of Newton-Schulz ({NS_STEPS} steps) its busiest owner has in this shape; "
        f"A100 bf16 peak is {A100_BF16_PEAK / 1e12:.0f}: the paper's setting must differ from this reading"
    )


def print_llama(rows, hybrid_rows, hybrid_rep):
    print(f"\n=== Llama-70B TP8 (TP-local shards, blockwise Muon; DP ranks on different nodes) on {A100.name} ===")
    print("step ms ours / recon (ratio); iteration ms: ours today, +overlap, +ring reduce, recon")
    for row in rows:
        gpus, so, sr, io, ioo, iring, ir, _ = row
        print(
            f"{gpus:>5} GPUs DP {gpus // 8:>4} | {1e3 * so:>5.0f} / {1e3 * sr:>5.0f} ({sr / so:>5.1f}x) | "
            f"{1e3 * io:>7.0f} {1e3 * ioo:>7.0f} {1e3 * iring:>6.0f} {1e3 * ir:>6.0f}"
        )
        _pred_line("llama", row)
    for gpus, so, _, io, ioo, iring, _, _ in hybrid_rows:
        print(
            f"hybrid --mfsdp-replicate-size {hybrid_rep(gpus)} at {gpus} GPUs (shard groups of 16 DP ranks): step "
            f"{1e3 * so:.0f} ms, iteration today {1e3 * io:.0f}, +overlap {1e3 * ioo:.0f}, +ring {1e3 * iring:.0f}"
        )


def print_fanout(rows, label):
    print(f"\n=== owner fan-out of the gather, one layer of {label} (fixed model, W data-parallel ranks) ===")
    print(f"{'W':>5} {'calls':>6} {'latency ms':>10} {'bandwidth ms':>12} {'fwd compute ms':>14}")
    for w, lat, bw, comp, calls in rows:
        print(f"{w:>5} {calls:>6} {1e3 * lat:>10.2f} {1e3 * bw:>12.2f} {1e3 * comp:>14.2f}")


def hybrid_at(shape: Shape, w: int, replicas: int):
    """Ours at W ranks, fully sharded vs hybrid (shard groups of W / replicas)."""
    full, hyb = plan_stats(unit_specs_for(shape), w), plan_stats(unit_specs_for(shape), w // replicas)
    ft, ht = unit_times(A100, shape, full, 1), unit_times(A100, shape, hyb, 1, replicas)
    sf, sh = step_ours(A100, full, w), step_ours(A100, hyb, w)
    itf, ith = iteration(A100, shape, full)[0] + sf, iteration(A100, shape, hyb, replicas)[0] + sh
    print(
        f"HYBRID W={w} replicate_size={replicas} shard={w // replicas} gather_lat_ms full={1e3 * ft.gather_lat:.3f} "
        f"hybrid={1e3 * ht.gather_lat:.3f} reduce_ms full={1e3 * ft.reduce:.2f} hybrid={1e3 * ht.reduce:.2f} "
        f"iter_ms full={1e3 * itf:.0f} hybrid={1e3 * ith:.0f} step_ms full={1e3 * sf:.0f} hybrid={1e3 * sh:.0f} "
        f"persistent_memory_x={replicas}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short calibration, no validation run, fewer points (CI)")
    p.add_argument("--no-validate", dest="validate", action="store_false", help="skip bench_optimizer_step.py --quick")
    p.add_argument("--plot", default=os.path.join(ROOT, "runs", "scaling_model.png"), help="PNG output path")
    args = p.parse_args(argv)
    print_assumptions()
    cal = calibrate(reps=3 if args.quick else 30)
    print_calibration(cal)
    if args.validate and not args.quick:
        print_validation(validate(cal, len(os.sched_getaffinity(0))))

    paper_rows = series(A100, paper_gpt, [8, 16, 32, 64] if args.quick else [8, 16, 32, 64, 128, 256])
    print_paper(paper_rows)
    llama_gpus = [64, 256, 1024] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024]
    llama_rows = series(A100_TP8, lambda g: LLAMA70B_TP8, llama_gpus, tp=8)
    rep = lambda g: max(1, (g // 8) // 16)  # noqa: E731  shard groups of 16 DP ranks
    hybrid_rows = [
        series(A100_TP8, lambda g: LLAMA70B_TP8, [g], tp=8, replicate=rep(g))[0] for g in llama_gpus if rep(g) > 1
    ]
    print_llama(llama_rows, hybrid_rows, rep)

    worlds = [8, 16, 32, 64, 128] if args.quick else [8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 1024]
    gpt25 = paper_gpt(64)
    fan_rows = fanout(A100, gpt25, worlds)
    print_fanout(fan_rows, "the 25.8B GPT (8 ranks per node)")
    w_bw, w_c = first_w(fan_rows, 2), first_w(fan_rows, 3)
    print(f"FANOUT model=gpt25.8B latency_exceeds_bandwidth_W={w_bw} latency_exceeds_compute_W={w_c}")
    llama_fan = fanout(A100_TP8, LLAMA70B_TP8, [w for w in worlds if w <= 128])
    print_fanout(llama_fan, "Llama-70B TP8 (DP ranks on different nodes)")
    print(
        f"FANOUT model=llama70b_tp8 latency_exceeds_bandwidth_W={first_w(llama_fan, 2)} "
        f"latency_exceeds_compute_W={first_w(llama_fan, 3)}"
    )
    w_at = w_bw or worlds[-1]
    hybrid_at(gpt25, w_at, max(1, w_at // GPUS_PER_NODE))
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    plot(args.plot, paper_rows, llama_rows, hybrid_rows, fan_rows, w_bw)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
