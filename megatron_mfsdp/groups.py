"""The process groups of one job, built once at set-up and passed explicitly.

Nothing below ``training/`` reads megatron's ``parallel_state`` globals: the wrapper,
the optimizer and the pipeline helpers take a :class:`ProcessGroups`.

With ``replicate_size`` R (hybrid sharding), each megatron data-parallel group of W
ranks is cut into R consecutive shard groups of W/R ranks (for example one node
each). Owners are planned inside a shard group; the ranks that hold the same segment
in different shard groups form a replica group, across which reduced gradient
segments are all-reduced. R = 1 is pure owner sharding; R = W is plain data
parallelism (every rank owns everything and runs every update).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from .node_levels import build_node_levels


def group_size(group) -> int:
    """Size of a group; 1 for None (a group that does not exist in this layout)."""
    return dist.get_world_size(group) if group is not None else 1


def gather_objects(value, group) -> list:
    """``value`` of every rank of ``group``, in group rank order (picklable values; [value] for None or
    a group of one). Collective over ``group``."""
    if group_size(group) == 1:
        return [value]
    out = [None] * group_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def group_rank(group) -> int:
    """This process's rank in a group; 0 for None."""
    return dist.get_rank(group) if group is not None else 0


@dataclass
class ProcessGroups:
    """Every group MatrixFSDP talks to."""

    dp: object
    """megatron's whole data-parallel group (losses are averaged over it)."""

    dp_shard: object
    """The ranks among which owners are planned (all of ``dp`` unless hybrid)."""

    replica: object | None = None
    """Ranks holding the same segment in other shard groups (hybrid sharding), else None."""

    tp: object | None = None
    """Tensor-parallel group (None without model parallelism)."""

    pp: object | None = None
    """Pipeline-parallel group (None without model parallelism)."""

    embedding: object | None = None
    """First and last pipeline stage, which both hold the tied embedding; None if this
    rank is in no such group or PP is 1."""

    grad_stats: object | None = None
    """Ranks that hold distinct gradient elements (norms, inf checks): the world."""

    # Mixture-of-experts groups, megatron-core's own (its MoE layers read the same ones); None
    # where a job builds no megatron layout. With EP 1 and expert TP = TP they exist too.
    ep: object | None = None
    """Expert-model-parallel group: ranks holding different experts of one layer."""

    expt_tp: object | None = None
    """Expert tensor-parallel group (megatron's default: the TP group's size)."""

    expt_dp: object | None = None
    """Expert data-parallel group: ranks holding the same experts, world / (expert TP x EP x PP)."""

    tp_ep_pp: object | None = None
    """Expert TP x EP x PP: the ranks that together hold one copy of the experts."""

    expt_dp_shard: object | None = None
    """The ranks of ``expt_dp`` among which expert owners are planned (all of it unless hybrid)."""

    expt_replica: object | None = None
    """Ranks of ``expt_dp`` holding the same expert segments in other shard groups (hybrid), else None."""

    dense_levels: object | None = None
    """The node layout of ``dp_shard`` (node_levels.NodeLevels: its node and rail groups), for owner
    collectives in two levels; None: every rank on one node."""

    @property
    def dp_shard_size(self) -> int:
        return group_size(self.dp_shard)

    @property
    def dp_shard_rank(self) -> int:
        return group_rank(self.dp_shard)

    @property
    def replica_size(self) -> int:
        return group_size(self.replica)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def ep_size(self) -> int:
        return group_size(self.ep)

    @property
    def ep_rank(self) -> int:
        return group_rank(self.ep)

    @property
    def expt_tp_size(self) -> int:
        return group_size(self.expt_tp)

    @property
    def expt_dp_size(self) -> int:
        return group_size(self.expt_dp)

    @property
    def expt_dp_rank(self) -> int:
        return group_rank(self.expt_dp)

    @classmethod
    def from_parallel_state(cls, replicate_size: int = 1, ranks_per_node: int | None = None) -> ProcessGroups:
        """Collective on every rank: megatron's groups (``initialize_model_parallel`` must have
        run) plus the shard and replica groups of hybrid sharding. The expert groups are megatron-core
        0.16.1's (megatron/core/parallel_state.py: get_expert_model_parallel_group,
        get_expert_tensor_parallel_group, get_expert_data_parallel_group,
        get_expert_tensor_model_pipeline_parallel_group), which it builds for every layout. At EP above 1
        (where experts have a shard domain of their own) the expert-DP group is split the same way into
        gcd(``replicate_size``, expert DP) replicas: as many as the smaller group allows, so a run
        replicated over DP is replicated over expert DP too. With ``ranks_per_node`` the dense shard
        group's node and rail groups are built too (node_levels.py)."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_group()
        shard, replica = data_parallel_groups(dp, replicate_size)
        ep, expt_dp = ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()
        expt_shard, expt_replica = expt_dp, None
        if group_size(ep) > 1:
            expt_shard, expt_replica = data_parallel_groups(expt_dp, math.gcd(replicate_size, group_size(expt_dp)))
        pp = ps.get_pipeline_model_parallel_group()
        embedding = None
        if group_size(pp) > 1 and ps.is_rank_in_embedding_group():
            embedding = ps.get_embedding_group()
        return cls(
            dp=dp,
            dp_shard=shard,
            replica=replica,
            tp=ps.get_tensor_model_parallel_group(),
            pp=pp,
            embedding=embedding,
            grad_stats=dist.group.WORLD,
            ep=ep,
            expt_tp=ps.get_expert_tensor_parallel_group(),
            expt_dp=expt_dp,
            tp_ep_pp=ps.get_expert_tensor_model_pipeline_parallel_group(),
            expt_dp_shard=expt_shard,
            expt_replica=expt_replica,
            dense_levels=build_node_levels(shard, ranks_per_node) if ranks_per_node else None,
        )

    @classmethod
    def data_parallel_only(cls, dp=None) -> ProcessGroups:
        """Every rank is one data-parallel rank (no TP, PP or replicas): the world, by default."""
        dp = dp if dp is not None else dist.group.WORLD
        return cls(dp=dp, dp_shard=dp, grad_stats=dp)


_LAYOUT: dict = {}


def initialize_model_parallel(tp: int = 1, pp: int = 1, vp: int | None = None, **kwargs) -> None:
    """megatron's ``initialize_model_parallel``, once per layout: a process that already holds
    the same layout keeps its groups (megatron refuses a second call, and every new gloo group
    adds polling threads); a different layout replaces them, and every group but the world is
    destroyed (megatron's ``destroy_model_parallel`` only forgets its groups, whose gloo threads
    would go on polling: 51 per rank for TP2 x PP2 x DP2)."""
    from megatron.core import parallel_state as ps

    layout = dict(tp=tp, pp=pp, vp=vp, **kwargs)
    if ps.model_parallel_is_initialized():
        if layout == _LAYOUT:
            return
        forget_layout()
    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp, **kwargs)
    _LAYOUT.update(layout)


def forget_layout() -> None:
    """megatron's ``destroy_model_parallel``, then destroy every process group of this process
    except the default one (a local call on gloo): megatron only drops its references."""
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    ps.destroy_model_parallel()
    world = c10d._get_default_group()
    for group in [g for g in c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)
    _LAYOUT.clear()


def split_data_parallel_ranks(dp_ranks: list[int], replicate_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replica groups) of one data-parallel group's global ranks."""
    world = len(dp_ranks)
    if replicate_size < 1 or world % replicate_size:
        raise ValueError(f"--mfsdp-replicate-size {replicate_size} must divide the data-parallel size {world}")
    shard = world // replicate_size
    shards = [dp_ranks[i * shard : (i + 1) * shard] for i in range(replicate_size)]
    replicas = [[s[j] for s in shards] for j in range(shard)]
    return shards, replicas


def data_parallel_groups(dp_group, replicate_size: int = 1):
    """Create (collectively, on every rank of the world) the shard and replica groups of
    every data-parallel group; return this rank's (shard, replica) pair."""
    if replicate_size == 1:
        return dp_group, None
    mine = dist.get_process_group_ranks(dp_group)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    my_shard = my_replica = None
    for ranks in sorted({tuple(r) for r in everyone}):
        shards, replicas = split_data_parallel_ranks(list(ranks), replicate_size)
        for members in shards:
            group = dist.new_group(members)
            if dist.get_rank() in members:
                my_shard = group
        for members in replicas:
            group = dist.new_group(members)
            if dist.get_rank() in members:
                my_replica = group
    return my_shard, my_replica
