"""A shard domain: the units whose segments live on one shard group, with that group's plan, its
communication and its gradient scaling.

Dense parameters are sharded over the DP shard group. Experts (issue 28) will be sharded over
megatron-core's expert-data-parallel group, and a rank sits in both, so the wrapper holds a domain
per shard group rather than one group, plan and comm per chunk: every gather, reduction and scaling
of a unit goes through the domain it belongs to."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ..groups import group_rank, group_size
from ..placement.collective_cost import MODE_ALGORITHM
from ..placement.collectives import choose_collectives
from ..placement.layout import Plan, UnitSpec
from ..placement.planner import RankLoads, plan_units
from ..placement.verify import verify_plan_agreement
from .comm import SegmentComm

DENSE = "dense"
EXPERT = "expert"


@dataclass
class ShardDomain:
    """One shard group's units and what moves and scales them."""

    name: str
    """What the domain holds: "dense" (today the only one), later "expert"."""

    shard: object
    """The ranks among which the domain's owners are planned (None: this rank alone)."""

    replica: object | None
    """Ranks holding the same segments in other shard groups (hybrid sharding), else None."""

    tp: object | None
    """The tensor-parallel group the domain's matrices are split over: TP for dense ones, megatron-core's
    expert TP for experts (None: not split). A matrix's TP shards share one owner, and the norm counts a
    parameter that this group duplicates on its rank 0 only."""

    plan: Plan
    """The owner plan of the domain's units, equal on every rank of ``shard`` (and of its TP group)."""

    comm: SegmentComm
    """Gathers and reductions over ``shard`` (then ``replica``)."""

    gradient_scaling_factor: float
    """Applied to every gradient as it is packed for reduction: 1 / the data-parallel ranks (DP shard x
    replica, for experts too), megatron DDP's average; 1 with a per-token loss (megatron's finalize
    step divides by the token count)."""

    units: list = field(default_factory=list)
    """The wrapper's unit states in this domain, in model order (each one's ``domain`` is this)."""

    @property
    def dp_rank(self) -> int:
        return group_rank(self.shard)

    @property
    def dp_size(self) -> int:
        return group_size(self.shard)

    @property
    def replica_rank(self) -> int:
        return group_rank(self.replica)

    @property
    def replica_size(self) -> int:
        return group_size(self.replica)


def build_domain(
    name: str,
    shard,
    replica,
    specs: list[UnitSpec],
    ddp_config,
    averaged_over: int | None,
    tp=None,
    base: RankLoads | None = None,
    param_bytes: int = 4,
    **comm_kwargs,
) -> ShardDomain:
    """Plan ``specs`` over ``shard`` and check that every rank of ``shard`` and of ``tp`` (a matrix's
    TP shards must share one owner) computed the same plan (``base``: each rank of ``shard``'s load in
    another domain, which the owners balance against: placement/planner.py); then the
    domain's comm (``comm_kwargs``: SegmentComm's verify, device, reduce_order) and scaling:
    1 / ``averaged_over``, the data-parallel ranks the loss is averaged over (None: 1, a per-token
    loss). Each unit's owner-collective algorithms (placement/collectives.py, --mfsdp-collectives) are
    chosen with the plan, for ``param_bytes`` per gathered element, and checked with it. Collective over
    those groups."""
    world = group_size(shard)
    plan = plan_units(specs, world, ddp_config.planner, base)
    comm = SegmentComm(shard=shard, replica=replica, **comm_kwargs)
    backend = dist.get_backend(shard) if world > 1 else "none"
    grad_bytes = 4 if ddp_config.grad_reduce_in_fp32 else param_bytes
    plan.collectives = choose_collectives(
        plan, comm.levels.per_node, backend, ddp_config.collectives, comm.reduce_order, param_bytes, grad_bytes
    )
    for group in (shard, tp):
        verify_plan_agreement(plan, group)
    forced = MODE_ALGORITHM.get(ddp_config.collectives)
    if forced is None:
        comm.choose(plan.collectives.choices())
    else:  # forced: also in rank order, where a chosen mapping may not replace the exact chain
        comm.choose({}, force=(forced, forced))
    return ShardDomain(name, shard, replica, tp, plan, comm, 1.0 / (averaged_over or 1))
