"""A calibrated scaling model: iteration and optimizer-step time of MatrixFSDP ("ours") against
ZeRO-3 with reconstruction Muon ("recon") from 8 to 1024 GPUs, without launching a GPU, for the
paper's weak-scaling GPT (hidden 4096, FFN 16384, 2 layers per GPU) and Llama-3-70B with TP 8.
Layouts are the library's own: plan_units on meta-tensor unit specs, so 1024 ranks need no process.

What each system is charged, per unit (a transformer layer, the embedding, the final norm) and
micro-batch (W = data-parallel ranks of the collective, U = the unit's elements):

ours     gather, in forward and again in backward: one NCCL group of one pipelined ring broadcast
         per non-empty owner part (k of them: the owners of the unit's matrices, a Q/K/V block
         counting as a matrix), rooted at its owner, plus one all_gather of the evenly split tail
         padded to ceil(T/W) per rank; bf16. Every rank sends and receives about U (W/(W-1) of
         ZeRO-3's). Latency: the k+1 ring latencies serialised (conservative: NCCL 2.22 splits one
         group's collectives over its channels by traffic, and NCCL 2.29 runs a group of broadcasts
         as one AllGatherV ring, src/scheduler/allgatherv_sched.cc; neither has run here), plus
         verify_collectives' signature (a 48-byte MAX all-reduce on NCCL's tree).
         Reduction: the mirror (one ring reduce per owner part into its owner, one reduce_scatter
         of the padded tail), fp32. Step: owner-local Newton-Schulz and AdamW tail of the busiest
         rank, and one 2-scalar all-reduce.
hybrid   --mfsdp-replicate-size R: the same inside shard groups of HYBRID_SHARD_RANKS data-parallel
         ranks (one node of the GPT; 8 nodes of the TP8 Llama, whose nodes hold one DP rank each),
         plus an all-reduce of each rank's segment over its R replicas after the owner reduction.
exact    ours with the rank-ordered reduction (opt-in on NCCL, the gloo default): the packed
         gradient flows 0 -> 1 -> ... -> W-1 in EXACT_CHUNK_BYTES chunks, then W-1 hands every
         owner its summed segment: (chunks + W - 1) pipelined p2p steps.
before   the all-to-all runtime, for comparison only: the gather as every owner sending its
         segment to each of its W-1 peers ((W-1) x the largest segment on one link), the
         reduction as one all_to_all_single (an owner receives W-1 copies of its segment).
recon    ZeRO-3 (FSDP2-style): one all_gather (bf16) and one reduce_scatter (fp32) per unit; the
         step all-gathers each matrix's fp32 direction and runs Newton-Schulz on every rank.
two_level  ours with every owner part broadcast (reduced) in two calls: over the owner's rail group
         (one rank per node) on the network, then inside each node on NVLink; the tail as ours.
bycost   ours with each unit's gather and reduction by the algorithm the cost model picks (parts,
         two_level or one padded all_gather/reduce_scatter): what --mfsdp-collectives auto runs.
limit    ZeRO-3's forward and backward (recon's collectives) with our owner-local step: what ours
         would be if its collectives cost ZeRO-3's (issue 30's yardstick).

Every collective is charged by megatron_mfsdp/placement/collective_cost.py's functions and
constants (the runtime's choice and this model use one source of truth).

Overlap, as the runtime runs on CUDA, the same for every system: the next unit's gather is
prefetched (PREFETCH_DEPTH) while the current one computes, in forward and in backward; a unit's
reduction starts asynchronously when its gradients are ready (overlap_grad_reduce), at most
MAX_REDUCES_IN_FLIGHT at once (the host waits for the oldest before starting another), and the
backward ends when the last one lands (finish_grad_sync). A rank's collectives share one FIFO
link (a process group's collectives run in order on one NCCL stream; separate groups would still
share the NIC), so a prefetched gather can wait behind reductions; compute runs beside it. The
tables show each phase's collective time (summed over units) and how much of it is exposed; the
"before" column is kept only to show what the rewrite removes.

Times are alpha-beta: a collective costs a host call + NCCL's latency (a base plus one hop per ring
step, NCCL's tuning model) + bytes / bus bandwidth; a matrix product costs a launch plus flops /
throughput; elementwise work a launch per op plus bytes / memory bandwidth. Every constant below is
named and commented. With this machine's calibrated figures (timed matmuls, a timed gloo all-gather
and broadcast on 2 processes) the step formulas predict benchmarks/bench_optimizer_step.py --quick,
which is run as a subprocess and compared.

    .venv/bin/python benchmarks/scaling_model.py            # calibrate, validate (~2-4 min), tables, plot
    .venv/bin/python benchmarks/scaling_model.py --quick    # CI smoke: short calibration, no validation run
    ... --table runs/scaling.md --plot runs/scaling.png     # also write the tables as markdown
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from types import SimpleNamespace

import torch

from megatron_mfsdp.compat.collectives import all_gather_single
from megatron_mfsdp.optim.newton_schulz import NewtonSchulzCost, newton_schulz_cost
from megatron_mfsdp.placement.collective_cost import (
    GPU_CALL_OVERHEAD_S,
    IB_BUS_BW,
    NCCL_BASE_LAT_S,
    NET_HOP_S,
    NVLINK_BUS_BW,
    NVLINK_HOP_S,
    PADDED,
    PARTS,
    TWO_LEVEL,
    CostConstants,
    Level,
    Topology,
    UnitShape,
    algorithm_time,
    algorithm_times,
    all_reduce_time,
    chain_time,
    fastest,
    slices_time,
    tree_latency,
)
from megatron_mfsdp.placement.collective_cost import (
    ring_latency as cost_ring_latency,
)
from megatron_mfsdp.runtime.chain import CHUNK_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------- assumptions
# The paper's cluster: A100-80GB, 8 per node (MatrixFSDP, arXiv 2607.05895, Section "Setup").
A100_BF16_PEAK = 312e12  # NVIDIA A100 datasheet: dense bf16 tensor-core peak, flop/s
A100_MEMORY_BYTES = 80e9  # A100-80GB datasheet: HBM per GPU (a hybrid point above it is marked infeasible)
NS_MATMUL_EFFICIENCY = 0.70  # assumed: cuBLAS bf16 GEMMs with all dims >= 1024 reach ~70% of peak
FWD_BWD_MFU = 0.50  # assumed model-flops utilization of GPT forward/backward at seq 4096
A100_HBM_BW = 2.0e12 * 0.8  # A100-80GB datasheet 2.0 TB/s; assumed 80% reached by elementwise kernels
GPU_LAUNCH_S = 5e-6  # assumed: host + launch cost of one CUDA kernel (matmul or elementwise op)
GPUS_PER_NODE = 8
# The collectives' latency and bandwidth (NCCL's tuning model: base, NVLink and network hop latencies,
# NVLink and IB bus bandwidths, the host call) are the cost model's constants and formulas
# (megatron_mfsdp/placement/collective_cost.py), imported above: the runtime's per-unit choice and
# this model charge the same numbers.
A2A_PEER_LAT_S = 1.0e-6  # assumed: per-peer cost of NCCL's grouped send/recv (the 'before' column only)
# Training settings (the paper's: hidden 4096, FFN 16384, seq 4096, bf16, activation checkpointing).
TOKENS_PER_GPU = 4096  # assumed: one 4096-token sequence per data-parallel rank and iteration
MICRO_BATCHES = 1  # assumed: no gradient accumulation (gathers and reductions are paid per micro-batch)
ACT_CKPT_PASSES = 4  # forward + recomputed forward + backward (2x): 4 forward-equivalents of flops
NS_STEPS = 5  # Newton-Schulz iterations (Megatron-LM's --muon-num-ns-steps default)
GPU_NS = NewtonSchulzCost(NS_STEPS, "bf16", "auto")  # on CUDA: bf16, so the standard iteration
CPU_NS = NewtonSchulzCost(NS_STEPS, "fp32", "auto", on_cpu=True)  # bench_optimizer_step.py's: Gram, symmetric products
PARAM_BYTES = 2  # bf16 parameters: the bytes of a forward/backward gather
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduction (MatrixFSDPConfig grad_reduce_in_fp32 default), both systems
RECON_GATHER_BYTES = 4  # reconstruction gathers the fp32 Nesterov direction (testing/baselines.py)
RECON_GATHER_PREFETCHED = False  # stock FSDP2 Muon: one blocking all-gather per matrix in the step
# The runtime's overlap on CUDA (MatrixFSDPConfig defaults; overlap_grad_reduce is on for CUDA).
PREFETCH_DEPTH = 1  # MatrixFSDPConfig.prefetch_depth: units gathered ahead (forward) / behind (backward)
MAX_REDUCES_IN_FLIGHT = 2  # MatrixFSDPConfig.max_reduces_in_flight
VERIFY_COLLECTIVES = True  # MatrixFSDPConfig.verify_collectives: a 48-byte MAX all-reduce per unit operation (ours)
EXACT_CHUNK_BYTES = CHUNK_BYTES  # runtime/chain.py: the rank-ordered chain's message size
HYBRID_SHARD_RANKS = GPUS_PER_NODE  # assumed: --mfsdp-replicate-size chosen so a shard group has 8 DP ranks
# Persistent bytes per owned element (docs/design.md "Memory per rank"): bf16 param 2 + fp32 grad 4
# + fp32 master 4 + Muon momentum 4 (AdamW's 8 on the small tail ignored); activations not counted.
PERSISTENT_BYTES_PER_ELEMENT = 14
LATENCY_SHOWS_FRACTION = 0.10  # the brief's threshold: ring latencies above 10% of a gather's bandwidth term
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
EQUAL_RTOL = 1e-9  # floating-point tolerance of "at or below" (DP 1: both systems are one program)

# The paper's published numbers (MatrixFSDP, arXiv 2607.05895, Table 2: optimizer step in ms,
# stock FSDP2 Muon -> MatrixFSDP; end-to-end speedup).
PAPER = {
    8: (3.2, 367.0, 87.0, 1.37),
    16: (6.4, 1285.0, 89.0, 1.75),
    32: (12.9, 3079.0, 91.0, 2.15),
    64: (25.8, 5064.0, 93.0, 2.01),
}
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
SYSTEMS = ("ours", "two_level", "bycost", "hybrid", "exact", "before", "recon", "limit")


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


@dataclass(frozen=True)
class Model:
    key: str  # RESULT lines' model=
    label: str
    shape_for: Callable[[int], Shape]  # GPUs -> the shape trained on them
    tp: int
    hw: Hardware


MODELS = (
    Model("gpt", "paper GPT (hidden 4096, FFN 16384, 2 layers per GPU)", paper_gpt, 1, A100),
    Model("llama", "Llama-3-70B TP8 (one DP rank per node)", lambda gpus: LLAMA70B_TP8, 8, A100_TP8),
)


# ----------------------------------------------------------------------------- the library's plan
@cache
def unit_specs_for(shape: Shape, ns: NewtonSchulzCost = GPU_NS):
    """UnitSpecs of a megatron-core GPT of this shape (TP-local), classified and costed by the library
    (placement.specs.unit_specs with the GPT adapter's rules), from meta tensors: nothing allocated."""
    from megatron_mfsdp import MatrixFSDPConfig
    from megatron_mfsdp.config import muon_rule_set
    from megatron_mfsdp.models.adapter import ModelUnit
    from megatron_mfsdp.models.gpt import GPT_ADAPTER
    from megatron_mfsdp.placement.specs import unit_specs

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
    return unit_specs(units, MatrixFSDPConfig(rules=muon_rule_set(ns)), GPT_ADAPTER, config)


def ns_flops(shape, split_rows, ns: NewtonSchulzCost = GPU_NS) -> int:
    """Flops of orthogonalizing one matrix (per Q/K/V block when split) with the kernel the optimizer
    picks for ``ns``: the planner's own count (optim/muon.py, checked against torch's flop counter
    in tests/unit/test_muon_gram.py), 2 flops per multiply-add."""
    return 2 * newton_schulz_cost(shape, split_rows, ns)


@dataclass(frozen=True)
class UnitStats:
    name: str
    numel: int  # U
    matrix: int  # elements of the owners' matrices
    tail: int  # T: elements split evenly
    parts: int  # k: non-empty owner parts (broadcasts of a gather, reduces of a reduction)
    max_segment: int  # the largest rank segment (matrix part + tail slice)
    shape: UnitShape  # what the cost model charges: owner parts, padded tail slice, largest segment


@dataclass
class PlanStats:
    """What the model needs of one plan: per rank and per unit."""

    world: int
    ns_flops: list[int]  # true Newton-Schulz flops per rank and step
    matrices: list[list[tuple]]  # per rank: (shape, split_rows) of owned matrices
    tail: list[int]  # tail elements per rank
    tail_pieces: list[int]  # tail pieces per rank
    owned: list[int]  # elements per rank (persistent memory)
    units: list[UnitStats]
    all_matrices: list[tuple]  # (shape, split_rows, numel) of every matrix
    all_tail: list[int]  # numel of every tail tensor
    planner_balance: str


@cache
def plan_for(shape: Shape, world: int, ns: NewtonSchulzCost = GPU_NS) -> PlanStats:
    """The library's plan of ``shape`` over ``world`` DP ranks, reduced to what the costs need."""
    from megatron_mfsdp.placement import WHOLE, plan_units

    specs = unit_specs_for(shape, ns)
    plan = plan_units(specs, world, "auto")
    ps = PlanStats(
        world, [0] * world, [[] for _ in range(world)], [0] * world, [0] * world, [0] * world, [], [], [], ""
    )
    for unit in plan.units:
        mb, tb = unit.matrix_bounds, unit.tail_bounds
        for slot in unit.slots:
            if slot.owner >= 0:
                ps.ns_flops[slot.owner] += ns_flops(slot.shape, slot.split_rows, ns)
                ps.matrices[slot.owner].append((slot.shape, slot.split_rows))
                ps.owned[slot.owner] += slot.numel
            else:
                _add_tail_slot(ps, tb, slot.offset - unit.matrix_numel, slot.numel)
        parts = sum(mb[r + 1] > mb[r] for r in range(world))
        biggest = max(mb[r + 1] - mb[r] + tb[r + 1] - tb[r] for r in range(world))
        shape = UnitShape.of(unit)
        ps.units.append(UnitStats(unit.name, unit.numel, unit.matrix_numel, unit.tail_numel, parts, biggest, shape))
    ps.all_matrices = [(p.shape, p.split_rows, p.numel) for u in specs for p in u.params if p.storage == WHOLE]
    ps.all_tail = [p.numel for u in specs for p in u.params if p.storage != WHOLE]
    ps.planner_balance = plan.report().splitlines()[-1]
    return ps


def _add_tail_slot(ps: PlanStats, bounds: list[int], lo: int, numel: int) -> None:
    """Charge a tail tensor at [lo, lo + numel) of the even tail split to the ranks it overlaps."""
    hi, r = lo + numel, bisect_right(bounds, lo) - 1
    while r < ps.world and bounds[r] < hi:
        n = min(hi, bounds[r + 1]) - max(lo, bounds[r])
        if n > 0:
            ps.tail[r] += n
            ps.tail_pieces[r] += 1
            ps.owned[r] += n
        r += 1


# ----------------------------------------------------------------------------- collectives
FLAT_RING_NICS = 1
"""NICs a flat ring spanning nodes drives per rank (--flat-ring-nics). 1 (the tables' default): every
network-crossing ring at one NIC's bandwidth per GPU. NCCL's multi-channel rings can spread over a node's
NICs (up to its DP ranks per node), while a rail group (one GPU a node) keeps its own NIC: with 8 the
flat rings (ZeRO-3's, our parts) get 8x the network bandwidth and two_level's rails do not."""


def costs_of(hw: Hardware) -> CostConstants:
    """The cost model's constants for this hardware (its host call, base latency and two levels)."""
    nics = min(FLAT_RING_NICS, hw.per_node)
    intra, inter = Level(hw.intra.hop_s, hw.intra.bus_bw), Level(hw.inter.hop_s, hw.inter.bus_bw * nics)
    return CostConstants(
        hw.call_s, hw.base_lat_s, intra, inter, chain_chunk_bytes=EXACT_CHUNK_BYTES, rail_bus_bw=hw.inter.bus_bw
    )


def topology(hw: Hardware, group: int) -> Topology:
    return Topology(group, hw.per_node)


def ring_latency(hw: Hardware, group: int, steps: int) -> float:
    """NCCL ring latency of an all-gather/reduce-scatter/all-reduce (the cost model's ring_latency)."""
    return cost_ring_latency(costs_of(hw), topology(hw, group), steps)


def all_gather(hw: Hardware, group: int, total_bytes: float) -> float:
    """Ring all-gather (or reduce-scatter: the same bytes and steps) of ``total_bytes`` in all."""
    return slices_time(costs_of(hw), topology(hw, group), total_bytes / group)


def all_reduce(hw: Hardware, group: int, nbytes: float) -> float:
    return all_reduce_time(costs_of(hw), topology(hw, group), nbytes)


def all_to_all(hw: Hardware, group: int, send: float, recv: float) -> float:
    """Uneven all-to-all ('before' column only); the busiest direction of a rank bounds it. Peers on
    the same node are reached over NVLink, the rest over the network."""
    if group == 1:
        return 0.0
    local = min(group, hw.per_node) - 1
    remote = (group - 1 - local) / (group - 1)
    worst = max(send, recv)
    bw_time = max(worst * (1 - remote) / hw.intra.bus_bw, worst * remote / hw.inter.bus_bw)
    return hw.call_s + hw.base_lat_s + (group - 1) * A2A_PEER_LAT_S + bw_time


def verify_latency(hw: Hardware, group: int) -> float:
    """verify_collectives: the signature's 48-byte MAX all-reduce before each owner collective (NCCL's
    tree: the cost model's tree_latency)."""
    return tree_latency(costs_of(hw), topology(hw, group)) if VERIFY_COLLECTIVES else 0.0


def owner_latency(hw: Hardware, group: int, u: UnitStats, algorithm: str = PARTS) -> float:
    """The latency of one owner gather/reduction by ``algorithm`` (the cost model at zero bytes): for
    parts, the k+1 ring latencies, serialised (conservative: NCCL may overlap a group's ops)."""
    return algorithm_time(algorithm, u.shape, topology(hw, group), 0, costs_of(hw))


def owner_bandwidth(hw: Hardware, group: int, u: UnitStats, elem_bytes: int, algorithm: str = PARTS) -> float:
    """The bandwidth term of one owner gather/reduction: for parts about U over the bus (every owner
    part through every rank once, (W-1)/W of the padded tail: W/(W-1) of ZeRO-3's)."""
    c, t = costs_of(hw), topology(hw, group)
    return algorithm_time(algorithm, u.shape, t, elem_bytes, c) - algorithm_time(algorithm, u.shape, t, 0, c)


def owner_collective(hw: Hardware, group: int, u: UnitStats, elem_bytes: int, algorithm: str = PARTS) -> float:
    """One owner gather (reduction: the mirror) by ``algorithm``, or the fastest by the cost model
    (``auto``: what --mfsdp-collectives auto picks), plus the signature check."""
    if group == 1:
        return 0.0
    c, t = costs_of(hw), topology(hw, group)
    if algorithm == "auto":
        algorithm = fastest(algorithm_times(u.shape, t, elem_bytes, c))
    return verify_latency(hw, group) + algorithm_time(algorithm, u.shape, t, elem_bytes, c)


def exact_reduction(hw: Hardware, group: int, u: UnitStats) -> float:
    """The rank-ordered chain (the cost model's chain_time: C chunks pipelined through W-1 links, then
    each owner handed its summed segment), plus the signature check."""
    if group == 1:
        return 0.0
    nbytes, segment = u.numel * GRAD_REDUCE_BYTES, u.max_segment * GRAD_REDUCE_BYTES
    return verify_latency(hw, group) + chain_time(costs_of(hw), topology(hw, group), nbytes, segment)


def before_gather(hw: Hardware, group: int, u: UnitStats) -> float:
    """The all-to-all runtime's gather: every owner sends its segment to each of its W-1 peers."""
    send, recv = (group - 1) * u.max_segment * PARAM_BYTES, u.numel * PARAM_BYTES
    return verify_latency(hw, group) + all_to_all(hw, group, send, recv) if group > 1 else 0.0


def before_reduction(hw: Hardware, group: int, u: UnitStats) -> float:
    """The all-to-all runtime's reduction: an owner receives W-1 full copies of its segment."""
    send, recv = u.numel * GRAD_REDUCE_BYTES, (group - 1) * u.max_segment * GRAD_REDUCE_BYTES
    return verify_latency(hw, group) + all_to_all(hw, group, send, recv) if group > 1 else 0.0


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


# ----------------------------------------------------------------------------- units and the pipeline
@dataclass(frozen=True)
class UnitCost:
    fwd: float  # forward compute
    bwd: float  # recomputed forward + backward compute
    gather: float  # one gather of the unit's parameters (forward, and again in backward)
    reduce: float  # its gradient reduction


def unit_compute(hw: Hardware, shape: Shape, ps: PlanStats, u: int) -> tuple[float, float]:
    """(forward, backward) compute of unit ``u``: 2 flops per parameter and token, attention on top
    for a layer, the TP all-reduces of the activations (over NVLink, not overlapped) under TP."""
    layer = 0 < u < len(ps.units) - 1
    flops = 2 * ps.units[u].numel * TOKENS_PER_GPU
    if layer:
        flops += 4 * TOKENS_PER_GPU**2 * shape.hidden // shape.tp
    tp_comm = 0.0
    if shape.tp > 1 and layer:  # 2 TP all-reduces of the activations per pass
        tp_hw = replace(hw, per_node=GPUS_PER_NODE)
        tp_comm = 2 * all_reduce(tp_hw, shape.tp, TOKENS_PER_GPU * shape.hidden * PARAM_BYTES)
    fwd = flops / hw.fwd_bwd_flops + tp_comm
    return fwd, (ACT_CKPT_PASSES - 1) * fwd


OWNER_ALGORITHM = {"two_level": TWO_LEVEL, "padded": PADDED, "bycost": "auto"}  # the rest: parts


def unit_comm(hw: Hardware, group: int, u: UnitStats, system: str, replicas: int = 1):
    """(gather, reduction) of one unit for ``system`` over ``group`` ranks."""
    if system == "recon":
        padded = -(-u.numel // group) * group
        return all_gather(hw, group, padded * PARAM_BYTES), all_gather(hw, group, padded * GRAD_REDUCE_BYTES)
    if system == "before":
        return before_gather(hw, group, u), before_reduction(hw, group, u)
    algorithm = OWNER_ALGORITHM.get(system, PARTS)
    gather = owner_collective(hw, group, u, PARAM_BYTES, algorithm)
    if system == "exact":
        reduce = exact_reduction(hw, group, u)
    else:
        reduce = owner_collective(hw, group, u, GRAD_REDUCE_BYTES, algorithm)
    if replicas > 1:  # hybrid: each segment all-reduced over its replicas, which sit on different nodes
        reduce += all_reduce(replace(hw, per_node=1), replicas, u.max_segment * GRAD_REDUCE_BYTES)
    return gather, reduce


@dataclass(frozen=True)
class Phases:
    fwd_gather: float  # collective time of the phase, summed over units
    bwd_gather: float
    reduce: float
    fwd: float  # wall time of the forward
    bwd: float  # wall time of the backward, until the last reduction has landed
    fwd_exposed: float  # of the forward's wall time, what compute does not cover
    bwd_exposed: float
    tail: float  # after the last backward compute: waiting for the reductions still in flight


def _pass(costs: list[UnitCost], order: list[int], t0: float, comm: float, backward: bool):
    """One pass over ``order``: gathers prefetched PREFETCH_DEPTH ahead, issued when a unit starts
    computing; in backward, each unit's reduction issued when its compute ends, at most
    MAX_REDUCES_IN_FLIGHT in flight (the host waits for the oldest first). Gathers and reductions
    share one FIFO link (comm: when it is next free). Returns (compute end, last landing, comm)."""
    ready, flight, comp = [], [], t0
    for i, j in enumerate(order):
        if len(ready) == i:  # not prefetched (the first unit): gathered once the previous compute is done
            comm = max(comm, comp) + costs[j].gather
            ready.append(comm)
        start = max(comp, ready[i])
        while len(ready) < min(len(order), i + 1 + PREFETCH_DEPTH):
            comm = max(comm, start) + costs[order[len(ready)]].gather
            ready.append(comm)
        comp = start + (costs[j].bwd if backward else costs[j].fwd)
        if backward:
            if len(flight) >= MAX_REDUCES_IN_FLIGHT:
                comp = max(comp, flight.pop(0))
            comm = max(comm, comp) + costs[j].reduce
            flight.append(comm)
    return comp, max([comp, *flight]), comm


def simulate(costs: list[UnitCost]) -> Phases:
    """Forward then backward of one micro-batch."""
    n = len(costs)
    fwd_end, _, comm = _pass(costs, list(range(n)), 0.0, 0.0, False)
    bwd_comp, bwd_end, _ = _pass(costs, list(range(n - 1, -1, -1)), fwd_end, comm, True)
    gathers = sum(c.gather for c in costs)
    fwd_c, bwd_c = sum(c.fwd for c in costs), sum(c.bwd for c in costs)
    bwd = bwd_end - fwd_end
    reduce = sum(c.reduce for c in costs)
    return Phases(gathers, gathers, reduce, fwd_end, bwd, fwd_end - fwd_c, bwd - bwd_c, bwd_end - bwd_comp)


@dataclass(frozen=True)
class Row:
    """One system at one GPU count of one model."""

    model: str
    gpus: int
    dp: int
    system: str
    replicas: int
    phases: Phases
    step: float
    mem_bytes: float  # persistent bytes per rank (the busiest)

    @property
    def iteration(self) -> float:
        return MICRO_BATCHES * (self.phases.fwd + self.phases.bwd) + self.step


def _costs(model: Model, shape: Shape, ps: PlanStats, system: str, replicas: int):
    costs = []
    for i, u in enumerate(ps.units):
        fwd, bwd = unit_compute(model.hw, shape, ps, i)
        costs.append(UnitCost(fwd, bwd, *unit_comm(model.hw, ps.world, u, system, replicas)))
    return costs


def hybrid_replicas(dp: int) -> int:
    return dp // min(dp, HYBRID_SHARD_RANKS)


def evaluate(model: Model, gpus: int, systems=SYSTEMS) -> dict[str, Row]:
    """Every system at ``gpus`` GPUs: per-phase times, step and persistent memory."""
    shape, dp, hw = model.shape_for(gpus), gpus // model.tp, model.hw
    full, reps = plan_for(shape, dp), hybrid_replicas(dp)
    shard = plan_for(shape, dp // reps)
    step_full = step_ours(hw, full, dp)
    rows = {}
    for system in systems:
        ps, r = (shard, reps) if system == "hybrid" else (full, 1)
        if system in ("recon", "limit"):  # the limit: ZeRO-3's forward/backward, our owner-local step
            step = step_full if system == "limit" else step_recon(hw, full)
            mem = sum(full.owned) / dp * PERSISTENT_BYTES_PER_ELEMENT
        else:
            step = step_ours(hw, ps, dp) if r > 1 else step_full
            mem = max(ps.owned) * PERSISTENT_BYTES_PER_ELEMENT
        phases = simulate(_costs(model, shape, ps, "recon" if system == "limit" else system, r))
        rows[system] = Row(model.key, gpus, dp, system, r, phases, step, mem)
    return rows


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
        out[("all_gather", n)] = _timeit(lambda x=x, full=full: all_gather_single(full, x), reps)
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
    rows = []
    for w, (ours_ms, recon_ms) in sorted(measured.items()):
        hw, ps = cpu_hardware(cal, w, cores), plan_for(QUICK_BENCH_SHAPE, w, CPU_NS)
        rows.append((w, ours_ms, 1e3 * step_ours(hw, ps, w), recon_ms, 1e3 * step_recon(hw, ps)))
    return rows


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


# ----------------------------------------------------------------------------- studies and output
LABELS = {
    "ours": "ours",
    "two_level": "ours two-level",
    "bycost": "ours by cost",
    "hybrid": "ours-hybrid",
    "exact": "ours-exact",
    "before": "before (all-to-all runtime)",
    "recon": "ZeRO-3 + recon",
    "limit": "limit (ZeRO-3 fwd/bwd + our step)",
}
LLAMA_DP_SWEEP = (8, 16, 32, 64, 128, 256, 512, 1024)  # DP ranks of Llama's latency study (64 to 8192 GPUs)


def _ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:,.0f}"


def _gb(row: Row) -> str:
    return f"{row.mem_bytes / 1e9:.1f}" + ("!" if row.mem_bytes > A100_MEMORY_BYTES else "")


def summary_table(model: Model, rows: dict) -> list[str]:
    out = [
        f"### {model.label}: iteration and step, ms (! = persistent state over the A100's 80 GB)",
        "",
        "| GPUs | DP | ours | ours-hybrid (R) | ours-exact | before (all-to-all) | ZeRO-3 + recon | recon/ours "
        "| paper e2e | step ours | step recon | paper step FSDP2 -> MatrixFSDP | GB/rank ours | GB/rank hybrid |",
        "|" + "---:|" * 14,
    ]
    for gpus, s in rows.items():
        o, h, r = s["ours"], s["hybrid"], s["recon"]
        pub = PAPER.get(gpus) if model.key == "gpt" else None
        cells = [
            str(gpus),
            str(o.dp),
            _ms(o.iteration),
            f"{_ms(h.iteration)} ({h.replicas})",
            _ms(s["exact"].iteration),
            _ms(s["before"].iteration),
            _ms(r.iteration),
            f"{r.iteration / o.iteration:.2f}",
            f"{pub[3]:.2f}" if pub else "-",
            _ms(o.step),
            _ms(r.step),
            f"{pub[1]:.0f} -> {pub[2]:.0f}" if pub else "-",
            _gb(o),
            _gb(h),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def phase_table(model: Model, rows: dict) -> list[str]:
    out = [
        f"### {model.label}: per phase, ms per iteration",
        "",
        "fwd/bwd gather, reduction: collective time summed over units; exposed: wall time that compute "
        "does not cover; bwd tail: waiting for the last reductions after the backward's compute.",
        "",
        "| GPUs | DP | system | fwd gather | bwd gather | reduction | fwd exposed | bwd exposed | bwd tail "
        "| step | iteration |",
        "|---:|---:|---|" + "---:|" * 8,
    ]
    for gpus, s in rows.items():
        for name, row in s.items():
            p = row.phases
            label = f"ours-hybrid R={row.replicas}" if name == "hybrid" else LABELS[name]
            cells = [
                p.fwd_gather,
                p.bwd_gather,
                p.reduce,
                p.fwd_exposed,
                p.bwd_exposed,
                p.tail,
                row.step,
                row.iteration,
            ]
            out.append(f"| {gpus} | {row.dp} | {label} | " + " | ".join(_ms(c) for c in cells) + " |")
    return out


def result_lines(model: Model, rows: dict) -> list[str]:
    out = []
    for gpus, s in rows.items():
        o, r = s["ours"], s["recon"]
        iters = " ".join(f"{k}_ms={1e3 * s[k].iteration:.3f}" for k in SYSTEMS)
        out.append(
            f"RESULT model={model.key} gpus={gpus} dp={o.dp} {iters} hybrid_replicas={s['hybrid'].replicas} "
            f"recon_over_ours={r.iteration / o.iteration:.4f} ours_step_ms={1e3 * o.step:.3f} "
            f"recon_step_ms={1e3 * r.step:.3f}"
        )
        for name, row in s.items():
            p = row.phases
            fields = dict(fwd_gather=p.fwd_gather, bwd_gather=p.bwd_gather, reduce=p.reduce, fwd_exposed=p.fwd_exposed)
            fields |= dict(bwd_exposed=p.bwd_exposed, tail=p.tail, step=row.step, iter=row.iteration)
            kv = " ".join(f"{k}_ms={1e3 * v:.3f}" for k, v in fields.items())
            out.append(f"PHASE model={model.key} gpus={gpus} system={name} {kv}")
    return out


def done_criterion(rows_by_model: dict) -> list[str]:
    """The issue's Done criterion: ours at or below ZeRO-3 + recon at every W, for both models."""
    out, every = [], True
    for model in MODELS:
        rows = rows_by_model[model.key]
        ratio = {g: s["recon"].iteration / s["ours"].iteration for g, s in rows.items()}
        failing = [g for g, s in rows.items() if s["ours"].iteration > s["recon"].iteration * (1 + EQUAL_RTOL)]
        worst = min(ratio, key=ratio.get)
        fails = ",".join(map(str, failing)) or "-"
        every &= not failing
        out.append(
            f"RESULT done_criterion model={model.key} ours_at_or_below_recon={'no' if failing else 'yes'} "
            f"worst_recon_over_ours={ratio[worst]:.3f} at_gpus={worst} failing_gpus={fails} "
            f"gpus={','.join(map(str, rows))}"
        )
    out.append(f"RESULT done_criterion all={'yes' if every else 'no'}")
    return out


LIMIT_DP = (8, 16, 32, 64, 128, 256, 512, 1024)  # issue 30: W (DP ranks) of the limit table, both models
LIMIT_SYSTEMS = ("ours", "two_level", "bycost", "recon", "limit")
LIMIT_TOLERANCE = 1.05  # issue 30's Done criterion: ours by cost within 5% of the limit at every W


def limit_rows(model: Model) -> dict[int, dict[str, Row]]:
    """W (DP ranks) -> the owner-collective variants, ZeRO-3 + recon and the limit, at W x TP GPUs."""
    return {w: evaluate(model, w * model.tp, LIMIT_SYSTEMS) for w in LIMIT_DP}


def bycost_choices(model: Model, dp: int) -> str:
    """How many units the cost model sends down each algorithm, gather and reduction ('p12 t3 d1':
    parts, two_level, padded)."""
    shape, c = model.shape_for(dp * model.tp), costs_of(model.hw)
    ps, t = plan_for(shape, dp), topology(model.hw, dp)
    out = []
    for elem in (PARAM_BYTES, GRAD_REDUCE_BYTES):
        picks = [fastest(algorithm_times(u.shape, t, elem, c)) for u in ps.units]
        out.append(" ".join(f"{letter}{picks.count(a)}" for letter, a in zip("ptd", (PARTS, TWO_LEVEL, PADDED))))
    return " / ".join(out)


def limit_table(model: Model, rows: dict) -> list[str]:
    out = [
        f"### {model.label}: owner collectives against the limit, iteration in ms",
        "",
        "limit: ZeRO-3's forward/backward (one all-gather and one reduce-scatter per unit) plus our "
        "owner-local step. by-cost choices: units per algorithm (p parts, t two_level, d padded), gather / reduce.",
        "",
        "| W (DP) | GPUs | ours | ours two-level | ours by cost | ZeRO-3 + recon | limit "
        "| ours / limit | two-level / limit | by cost / limit | by-cost choices |",
        "|" + "---:|" * 10 + "---|",
    ]
    for w, s in rows.items():
        limit = s["limit"].iteration
        cells = [str(w), str(w * model.tp)] + [_ms(s[k].iteration) for k in LIMIT_SYSTEMS]
        cells += [f"{s[k].iteration / limit:.3f}" for k in ("ours", "two_level", "bycost")]
        out.append("| " + " | ".join(cells + [bycost_choices(model, w)]) + " |")
    return out


def limit_criterion(limits: dict) -> list[str]:
    """Issue 30's Done criterion: ours by cost <= LIMIT_TOLERANCE x the limit at every W, both models."""
    out, every = [], True
    for model in MODELS:
        ratio = {w: s["bycost"].iteration / s["limit"].iteration for w, s in limits[model.key].items()}
        failing = [w for w, r in ratio.items() if r > LIMIT_TOLERANCE * (1 + EQUAL_RTOL)]
        worst = max(ratio, key=ratio.get)
        every &= not failing
        out.append(
            f"RESULT limit_criterion model={model.key} bycost_within_{LIMIT_TOLERANCE}x_limit="
            f"{'no' if failing else 'yes'} worst_bycost_over_limit={ratio[worst]:.3f} at_dp={worst} "
            f"failing_dp={','.join(map(str, failing)) or '-'}"
        )
    out.append(f"RESULT limit_criterion all={'yes' if every else 'no'}")
    return out


def paper_note() -> str:
    ps, paper_ms = plan_for(paper_gpt(8), 8), PAPER[8][2]
    busiest = max(ps.ns_flops)
    need = busiest / (paper_ms / 1e3)
    return (
        f"note: the paper's {paper_ms:.0f} ms step at 8 GPUs needs {need / 1e12:.0f} TFLOP/s for the "
        f"{busiest / 1e12:.1f} TFLOP of Newton-Schulz ({NS_STEPS} steps) its busiest owner has in this shape; "
        f"A100 bf16 peak is {A100_BF16_PEAK / 1e12:.0f}: the paper's setting must differ from this reading"
    )


def latency_points(model: Model, gpus_list) -> list[SimpleNamespace]:
    """Per GPU count, the busiest layer unit (most owner parts, then most elements): its gather's k+1
    ring latencies, bandwidth term and forward compute."""
    points = []
    for gpus in gpus_list:
        shape, dp = model.shape_for(gpus), gpus // model.tp
        ps = plan_for(shape, dp)
        i = max(range(1, len(ps.units) - 1), key=lambda k: (ps.units[k].parts, ps.units[k].numel))
        u = ps.units[i]
        bw = owner_bandwidth(model.hw, dp, u, PARAM_BYTES)
        lat, two = owner_latency(model.hw, dp, u), owner_latency(model.hw, dp, u, TWO_LEVEL)
        fwd = unit_compute(model.hw, shape, ps, i)[0]
        points.append(SimpleNamespace(gpus=gpus, dp=dp, unit=u, lat=lat, two=two, bw=bw, fwd=fwd))
    return points


def _two_level_saving(model: Model, gpus: int) -> tuple[float, float]:
    """(flat, two-level) iteration of ours at ``gpus`` GPUs."""
    rows = evaluate(model, gpus, ("ours", "two_level"))
    return rows["ours"].iteration, rows["two_level"].iteration


def _where(p: SimpleNamespace, model: Model, detail: str = "") -> str:
    """'W=dp' with the GPU count where it differs, and ``detail``, in one parenthesis."""
    inner = "; ".join(x for x in (f"{p.gpus} GPUs" if model.tp > 1 else "", detail) if x)
    return f"W={p.dp}" + (f" ({inner})" if inner else "")


def _threshold_text(model: Model, pts: list, w10, wc) -> str:
    u, first, last, pct = (w10 or pts[-1]).unit, pts[0], pts[-1], round(100 * LATENCY_SHOWS_FRACTION)
    text = (
        f"{model.label}: the busiest layer unit ({u.name}: k={u.parts} owner parts + {int(u.tail > 0)} tail "
        f"all-gather, {u.numel * PARAM_BYTES / 1e6:.0f} MB bf16) has k+1 ring latencies of {_ms(first.lat)} ms "
        f"per gather against {_ms(first.bw)} ms of bandwidth at {_where(first, model)}. They "
    )
    p = w10 or last
    text += f"pass {pct}% of the bandwidth term at " if w10 else f"stay under {pct}% of the bandwidth term up to "
    text += _where(p, model, f"{_ms(p.lat)} vs {_ms(p.bw)} ms")
    p = wc or last
    text += " and the unit's forward compute at " if wc else " and stay under its forward compute up to "
    return text + _where(p, model, f"{_ms(p.lat)} vs {_ms(p.fwd)} ms") + ". "


def _two_level_text(model: Model, at, last, saving: tuple, saving_last: tuple) -> str:
    (flat, two), (flat_last, two_last) = saving, saving_last
    if model.hw.per_node == 1:
        return (
            f"Each node holds one of its DP ranks, so a two-level broadcast/reduce has nothing to do inside a node "
            f"and saves {_ms(flat - two)} ms per iteration at {_where(at, model)}."
        )
    n = model.hw.per_node
    return (
        f"A two-level broadcast/reduce (across nodes on the owner's rail group, then inside each node: two base "
        f"latencies + W/{n} network hops + {n} NVLink hops instead of W network hops, and a second pass of the "
        f"bytes over NVLink) cuts that gather's latency from {_ms(at.lat)} to {_ms(at.two)} ms at "
        f"{_where(at, model)} and changes an iteration there by {_ms(two - flat)} ms ({_ms(flat)} -> {_ms(two)} ms, "
        f"{100 * (two / flat - 1):+.1f}%); at {_where(last, model)}, {_ms(last.lat)} -> {_ms(last.two)} ms per "
        f"gather and {_ms(two_last - flat_last)} ms per iteration ({100 * (two_last / flat_last - 1):+.1f}%). "
        "Ours by cost takes it per unit only where it is faster."
    )


def latency_study(model: Model, gpus_list) -> list[str]:
    """Where the per-part ring latency starts to show, and what a two-level version saves there."""
    pts = latency_points(model, gpus_list)
    w10 = next((p for p in pts if p.lat > LATENCY_SHOWS_FRACTION * p.bw), None)
    wc = next((p for p in pts if p.lat > p.fwd), None)
    at, last = w10 or pts[-1], pts[-1]
    saving, saving_last = _two_level_saving(model, at.gpus), _two_level_saving(model, last.gpus)
    text = _threshold_text(model, pts, w10, wc) + _two_level_text(model, at, last, saving, saving_last)
    line = (
        f"LATENCY model={model.key} busiest={at.unit.name} parts={at.unit.parts} w_10pct={w10.dp if w10 else 'none'} "
        f"w_compute={wc.dp if wc else 'none'} at_w={at.dp} flat_iter_ms={1e3 * saving[0]:.3f} "
        f"two_level_iter_ms={1e3 * saving[1]:.3f} saving_ms={1e3 * (saving[0] - saving[1]):.3f} "
        f"last_w={last.dp} saving_last_ms={1e3 * (saving_last[0] - saving_last[1]):.3f}"
    )
    return [text, line]


def print_assumptions():
    print("=== assumptions (named constants in benchmarks/scaling_model.py) ===")
    names = [k for k, v in globals().items() if k.isupper() and isinstance(v, (int, float, bool)) and k != "ROOT"]
    print(", ".join(f"{k}={globals()[k]:g}" for k in names))


STYLES = {
    "ours": "o-",
    "two_level": "^-",
    "bycost": "v-",
    "hybrid": "x--",
    "exact": "d:",
    "before": "+-.",
    "recon": "s-",
    "limit": "k:",
}


def plot(path: str, rows_by_model: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(18, 5.2))
    for a, model in zip(ax, MODELS):
        rows = rows_by_model[model.key]
        g = list(rows)
        for name in SYSTEMS:
            a.plot(g, [rows[x][name].iteration for x in g], STYLES[name], label=LABELS[name])
        over = [(x, n) for x in g for n in ("ours", "hybrid") if rows[x][n].mem_bytes > A100_MEMORY_BYTES]
        a.plot(
            [x for x, _ in over],
            [rows[x][n].iteration for x, n in over],
            "o",
            mfc="none",
            mec="red",
            ms=11,
            label="persistent state > 80 GB per GPU",
        )
        a.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="iteration (fwd + bwd + step), s", title=model.label)
        a.set_xticks(g, [str(x) for x in g])
    for model, mark in zip(MODELS, "os"):
        rows = rows_by_model[model.key]
        g = list(rows)
        ratio = [rows[x]["recon"].iteration / rows[x]["ours"].iteration for x in g]
        ax[2].plot(g, ratio, mark + "-", label=f"{model.key}: recon / ours (model)")
        for x, y in zip(g, ratio):
            ax[2].annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    pw = sorted(PAPER)
    ax[2].plot(pw, [PAPER[w][3] for w in pw], "k*--", ms=11, label="paper end-to-end speedup (GPT)")
    ax[2].axhline(1.0, color="gray", ls=":")
    ax[2].set(xscale="log", xlabel="GPUs", ylabel="iteration recon / ours", title="speedup")
    ax[2].set_xticks(GPU_COUNTS, [str(x) for x in GPU_COUNTS])
    for a in ax:
        a.legend(fontsize=7)
        a.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short calibration, no validation run (CI)")
    p.add_argument(
        "--flat-ring-nics",
        type=int,
        default=1,
        help="NICs a flat ring spanning nodes drives per GPU (NCCL's channels over a node's NICs); rails keep one",
    )
    p.add_argument("--no-validate", dest="validate", action="store_false", help="skip bench_optimizer_step.py --quick")
    p.add_argument("--plot", default=os.path.join(ROOT, "runs", "scaling_model.png"), help="PNG output path")
    p.add_argument("--table", default=None, help="also write the tables and findings as markdown to this path")
    args = p.parse_args(argv)
    global FLAT_RING_NICS
    if args.flat_ring_nics < 1:
        p.error(f"--flat-ring-nics must be at least 1, got {args.flat_ring_nics}")
    FLAT_RING_NICS = args.flat_ring_nics
    print_assumptions()
    cal = calibrate(reps=3 if args.quick else 30)
    print_calibration(cal)
    if args.validate and not args.quick:
        print_validation(validate(cal, len(os.sched_getaffinity(0))))

    rows = {m.key: {g: evaluate(m, g) for g in GPU_COUNTS} for m in MODELS}
    md = [f"## Scaling model on {A100.name}", ""]
    for m in MODELS:
        md += summary_table(m, rows[m.key]) + [""] + phase_table(m, rows[m.key]) + [""]
    md += [paper_note(), ""]
    sweeps = {"gpt": GPU_COUNTS, "llama": tuple(8 * w for w in LLAMA_DP_SWEEP)}
    findings = [line for m in MODELS for line in latency_study(m, sweeps[m.key])]
    md += ["### Where the per-part ring latency shows"]
    md += [x for f in findings if not f.startswith("LATENCY") for x in ("", f)]
    limits = {m.key: limit_rows(m) for m in MODELS}
    for m in MODELS:
        md += [""] + limit_table(m, limits[m.key])
    criterion = done_criterion(rows) + limit_criterion(limits)
    md += ["", "### Done criterion", ""] + [f"`{c}`" for c in criterion]
    print("\n" + "\n".join(md))
    for m in MODELS:
        print("\n".join(result_lines(m, rows[m.key])))
    print("\n".join(f for f in findings if f.startswith("LATENCY")))
    print("\n".join(criterion))
    if args.table:
        os.makedirs(os.path.dirname(os.path.abspath(args.table)), exist_ok=True)
        with open(args.table, "w") as f:
            f.write("\n".join(md) + "\n")
        print(f"table: {args.table}")
    os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
    plot(args.plot, rows)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
