"""The Muon baselines that benchmarks and tests compare MatrixFSDP with, built on the
library's own Muon and AdamW math (so a difference is placement, never arithmetic).

replicated       plain data parallelism: every rank holds every full matrix and runs
                 Muon on all of them (gradients already all-reduced).
reconstruction   FSDP2-style ZeRO-3 Muon: every tensor is stored as even flat shards
                 (numel/W per rank, padded to a multiple of W); per step and matrix the
                 rank updates its momentum shard, all-gathers the full direction, runs
                 Newton-Schulz on every rank and keeps its slice of the update.
layer-wise       Megatron-LM HEAD's LayerWiseDistributedOptimizer: full replicas, each
                 matrix stepped by one owner, then an all-gather of the updated tensors.

All take ``matrices`` as (name, shape, split_rows, param, grad) and ``tail`` as
(name, weight decay, param, grad), full tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..compat.collectives import all_gather_single
from ..optim import muon
from ..optim.adamw import adamw_step_
from ..optim.matrix import apply_decoupled_


class BaselineHyper:
    """The hyperparameters of a MatrixFSDPOptimizerConfig, as the baselines use them: Muon's step
    (optim/muon.py hyper_in) and the AdamW tail's."""

    def __init__(self, cfg):
        self.lr, self.wd = cfg.lr, cfg.weight_decay
        self.muon = muon.hyper_in(cfg)
        self.beta1, self.beta2, self.eps = cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps


def adamw_tail_(tail, h: BaselineHyper, step_count: int) -> None:
    """AdamW on every tail tensor a baseline holds, elementwise."""
    b1, b2 = h.beta1, h.beta2
    for t in tail:
        adamw_step_(
            t["param"],
            t["grad"],
            t["m"],
            t["v"],
            lr=h.lr,
            weight_decay=t["wd"],
            beta1=b1,
            beta2=b2,
            eps=h.eps,
            bias_correction1=1 - b1**step_count,
            bias_correction2=1 - b2**step_count,
        )


def baseline_bytes(matrices, tail) -> dict:
    """Persistent bytes of a baseline's tensors (fp32 params are their own masters)."""
    ts = matrices + tail
    return {
        "params": sum(t["param"].nbytes for t in ts),
        "grads": sum(t["grad"].nbytes for t in ts),
        "masters": 0,
        "optimizer_state": sum(t["buf"].nbytes for t in matrices) + sum(t["m"].nbytes + t["v"].nbytes for t in tail),
    }


class ReplicatedMuon:
    """Every rank: full params, full (already reduced) grads, full state; no communication."""

    def __init__(self, matrices, tail, h: BaselineHyper):
        self.h = h
        self.step_count = 0
        self.matrices = [
            dict(name=n, shape=s, qkv=q, param=p.clone(), grad=g.clone(), buf=torch.zeros_like(p))
            for n, s, q, p, g in matrices
        ]
        self.tail = [
            dict(
                name=n,
                wd=wd,
                param=p.reshape(-1).clone(),
                grad=g.reshape(-1).clone(),
                m=torch.zeros(p.numel()),
                v=torch.zeros(p.numel()),
            )
            for n, wd, p, g in tail
        ]

    @torch.no_grad()
    def step(self) -> float:
        h = self.h
        self.step_count += 1
        sumsq = torch.zeros((), dtype=torch.float64)
        for t in self.matrices + self.tail:
            sumsq += t["grad"].double().square().sum()
        for t in self.matrices:
            muon.muon_step_(t["param"], t["grad"], t["buf"], h.muon, lr=h.lr, weight_decay=h.wd, split_rows=t["qkv"])
        adamw_tail_(self.tail, h, self.step_count)
        return math.sqrt(sumsq.item())

    def full_params(self):
        return {t["name"]: t["param"] for t in self.matrices} | {t["name"]: t["param"] for t in self.tail}

    def local_bytes(self):
        return baseline_bytes(self.matrices, self.tail)


def even_shard(full: torch.Tensor, rank: int, world: int):
    """This rank's even flat shard (padded to a multiple of W) and its number of real elements."""
    flat = full.reshape(-1)
    per = -(-flat.numel() // world)
    lo, hi = min(rank * per, flat.numel()), min((rank + 1) * per, flat.numel())
    shard = torch.zeros(per, dtype=full.dtype)
    shard[: hi - lo].copy_(flat[lo:hi])
    return shard, hi - lo


class ReconstructionMuon:
    """ZeRO-3 even shards; per matrix: all-gather the direction, Newton-Schulz on every rank,
    keep the local slice. The AdamW tail is elementwise and needs no communication."""

    def __init__(self, matrices, tail, h: BaselineHyper, group, rank, world, prefetch=False):
        self.h, self.group, self.rank, self.world, self.prefetch = h, group, rank, world, prefetch
        self.step_count = 0
        self.matrices = []
        for n, s, q, p, g in matrices:
            ps, valid = even_shard(p, rank, world)
            self.matrices.append(
                dict(
                    name=n,
                    shape=s,
                    qkv=q,
                    numel=p.numel(),
                    param=ps,
                    grad=even_shard(g, rank, world)[0],
                    buf=torch.zeros_like(ps),
                    valid=valid,
                )
            )
        self.tail = []
        for n, wd, p, g in tail:
            ps, valid = even_shard(p, rank, world)
            self.tail.append(
                dict(
                    name=n,
                    wd=wd,
                    numel=p.numel(),
                    param=ps,
                    grad=even_shard(g, rank, world)[0],
                    m=torch.zeros_like(ps),
                    v=torch.zeros_like(ps),
                    valid=valid,
                )
            )

    def _gather(self, t):
        direction = muon.prepare(t["grad"], {muon.STATE: t["buf"]}, self.h.muon)
        full = torch.empty(t["param"].numel() * self.world, dtype=direction.dtype)
        work = all_gather_single(full, direction, group=self.group, async_op=self.prefetch)
        return full, work

    @torch.no_grad()
    def step(self) -> float:
        h = self.h
        self.step_count += 1
        sumsq = torch.zeros(1, dtype=torch.float64)
        for t in self.matrices + self.tail:
            sumsq += t["grad"].double().square().sum()
        dist.all_reduce(sumsq, group=self.group)
        pending = self._gather(self.matrices[0]) if self.prefetch else None
        for i, t in enumerate(self.matrices):
            if self.prefetch:
                full, work = pending
                work.wait()
                if i + 1 < len(self.matrices):
                    pending = self._gather(self.matrices[i + 1])
            else:
                full, _ = self._gather(t)
            whole, rows = full[: t["numel"]].view(t["shape"]), t["qkv"]
            update, scale = muon.direction(whole, {}, h.muon, 0, rows), muon.scale(t["shape"], h.muon, rows)
            lo = self.rank * t["param"].numel()
            apply_decoupled_(t["param"][: t["valid"]], update.reshape(-1)[lo : lo + t["valid"]], h.lr, h.wd, scale)
        adamw_tail_(self.tail, h, self.step_count)
        return math.sqrt(sumsq.item())

    def full_params(self):
        """Collective: all-gather every shard (for the correctness check only)."""
        out = {}
        for t in self.matrices + self.tail:
            full = torch.empty(t["param"].numel() * self.world)
            all_gather_single(full, t["param"], group=self.group)
            out[t["name"]] = full[: t["numel"]]
        return out

    def local_bytes(self):
        return baseline_bytes(self.matrices, self.tail)


def _lpt(costs: list[float], world: int) -> list[int]:
    """Longest processing time first: each item (largest cost first) to the least-loaded rank."""
    loads, owners = [0.0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owners[i] = min(range(world), key=lambda r: loads[r])
        loads[owners[i]] += costs[i]
    return owners


class LayerWiseMuon:
    """Megatron-LM HEAD's LayerWiseDistributedOptimizer as a placement (optimizer/layer_wise_optimizer.py):
    every rank keeps every full parameter and reduced gradient (ZeRO-1 memory); each matrix has one owner in
    ``group``, balanced by Newton-Schulz cost (longest first, as its compute-balanced layout), and each tail
    tensor one owner balanced by size; an owner alone holds its tensors' optimizer state and steps them;
    then one all-gather of the owners' updated tensors (padded to the largest rank's) refreshes every
    replica. The gradient norm sums the owned gradients over ``group``."""

    def __init__(self, matrices, tail, h: BaselineHyper, group, rank, world):
        self.h, self.group, self.rank, self.world = h, group, rank, world
        self.step_count = 0
        cost = [s[0] * s[1] * min(s[0], s[1]) for _, s, _, _, _ in matrices]
        self.matrices = [
            dict(name=n, shape=s, qkv=q, param=p.clone(), grad=g.clone(), owner=o)
            for (n, s, q, p, g), o in zip(matrices, _lpt(cost, world))
        ]
        self.tail = [
            dict(name=n, wd=wd, param=p.reshape(-1).clone(), grad=g.reshape(-1).clone(), owner=o)
            for (n, wd, p, g), o in zip(tail, _lpt([p.numel() for _, _, p, _ in tail], world))
        ]
        for t in self.matrices:
            if t["owner"] == rank:
                t["buf"] = torch.zeros_like(t["param"])
        for t in self.tail:
            if t["owner"] == rank:
                t["m"], t["v"] = torch.zeros_like(t["param"]), torch.zeros_like(t["param"])
        loads = [0] * world
        for t in self.matrices + self.tail:
            loads[t["owner"]] += t["param"].numel()
        self.per_rank = max(loads)

    def _owned(self, ts, rank):
        return [t for t in ts if t["owner"] == rank]

    @torch.no_grad()
    def step(self) -> float:
        h = self.h
        self.step_count += 1
        mine = self._owned(self.matrices, self.rank)
        sumsq = torch.zeros(1, dtype=torch.float64)
        for t in mine + self._owned(self.tail, self.rank):
            sumsq += t["grad"].double().square().sum()
        dist.all_reduce(sumsq, group=self.group)
        for t in mine:
            muon.muon_step_(t["param"], t["grad"], t["buf"], h.muon, lr=h.lr, weight_decay=h.wd, split_rows=t["qkv"])
        adamw_tail_(self._owned(self.tail, self.rank), h, self.step_count)
        # The all-gather after the step: each rank's updated tensors, in model order, padded to one size.
        send = torch.zeros(self.per_rank)
        at = 0
        for t in self._owned(self.matrices + self.tail, self.rank):
            send[at : at + t["param"].numel()].copy_(t["param"].reshape(-1))
            at += t["param"].numel()
        full = torch.empty(self.per_rank * self.world)
        all_gather_single(full, send, group=self.group)
        for r in range(self.world):
            at = r * self.per_rank
            for t in self._owned(self.matrices + self.tail, r):
                if r != self.rank:
                    t["param"].reshape(-1).copy_(full[at : at + t["param"].numel()])
                at += t["param"].numel()
        return math.sqrt(sumsq.item())

    def full_params(self):
        return {t["name"]: t["param"] for t in self.matrices} | {t["name"]: t["param"] for t in self.tail}

    def local_bytes(self):
        ts = self.matrices + self.tail
        return {
            "params": sum(t["param"].nbytes for t in ts),
            "grads": sum(t["grad"].nbytes for t in ts),
            "masters": 0,
            "optimizer_state": sum(t[k].nbytes for t in ts for k in ("buf", "m", "v") if k in t),
        }
