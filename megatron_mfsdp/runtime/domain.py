"""A shard domain: the units whose segments live on one shard group, with that group's plan, its
communication and its gradient scaling.

Dense parameters are sharded over the DP shard group. Experts (issue 28) will be sharded over
megatron-core's expert-data-parallel group, and a rank sits in both, so the wrapper holds a domain
per shard group rather than one group, plan and comm per chunk: every gather, reduction and scaling
of a unit goes through the domain it belongs to."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..groups import group_rank, group_size
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
    **comm_kwargs,
) -> ShardDomain:
    """Plan ``specs`` over ``shard`` and check that every rank of ``shard`` and of ``tp`` (a matrix's
    TP shards must share one owner) computed the same plan (``base``: each rank of ``shard``'s load in
    another domain, which the owners balance against: placement/planner.py); then the
    domain's comm (``comm_kwargs``: SegmentComm's verify, device, reduce_order) and scaling:
    1 / ``averaged_over``, the data-parallel ranks the loss is averaged over (None: 1, a per-token
    loss). Collective over those groups."""
    world = group_size(shard)
    plan = plan_units(specs, world, ddp_config.planner, base)
    for group in (shard, tp):
        verify_plan_agreement(plan, group)
    comm = SegmentComm(shard=shard, replica=replica, **comm_kwargs)
    return ShardDomain(name, shard, replica, tp, plan, comm, 1.0 / (averaged_over or 1))
