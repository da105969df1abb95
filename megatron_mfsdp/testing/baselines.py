"""The Muon baselines that benchmarks and tests compare MatrixFSDP with, built on the
library's own Muon and AdamW math (so a difference is placement, never arithmetic).

replicated       plain data parallelism: every rank holds every full matrix and runs
                 Muon on all of them (gradients already all-reduced).
reconstruction   FSDP2-style ZeRO-3 Muon: every tensor is stored as even flat shards
                 (numel/W per rank, padded to a multiple of W); per step and matrix the
                 rank updates its momentum shard, all-gathers the full direction, runs
                 Newton-Schulz on every rank and keeps its slice of the update.

Both take ``matrices`` as (name, shape, split_rows, param, grad) and ``tail`` as
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
