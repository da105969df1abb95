"""Data-parallel process groups for MatrixFSDP: owner (shard) groups and replica groups.

With ``replicate_size`` R, each megatron data-parallel group of W ranks is cut
into R consecutive shard groups of W/R ranks (for example one node each).
Owners are planned inside a shard group; the ranks that hold the same segment
in different shard groups form a replica group, across which reduced gradient
segments are all-reduced. R = 1 is pure owner sharding; R = W is plain data
parallelism (every rank owns everything and runs every update).
"""

from __future__ import annotations

from typing import List, Tuple

import torch.distributed as dist


def split_data_parallel_ranks(dp_ranks: List[int], replicate_size: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(shard groups, replica groups) of one data-parallel group's global ranks."""
    world = len(dp_ranks)
    if replicate_size < 1 or world % replicate_size:
        raise ValueError(f"--mfsdp-replicate-size {replicate_size} must divide the data-parallel size {world}")
    shard = world // replicate_size
    shards = [dp_ranks[i * shard:(i + 1) * shard] for i in range(replicate_size)]
    replicas = [[s[j] for s in shards] for j in range(shard)]
    return shards, replicas


def data_parallel_groups(replicate_size: int = 1, dp_group=None):
    """Create (collectively, on every rank of the world) the shard and replica
    groups of every data-parallel group; return this rank's (shard, replica) pair."""
    if dp_group is None:
        from megatron.core import parallel_state

        dp_group = parallel_state.get_data_parallel_group()
    mine = dist.get_process_group_ranks(dp_group)
    if replicate_size == 1:
        return dp_group, None
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
