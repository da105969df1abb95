"""The node layout of a shard group: which of its ranks share a node (fast links: NVLink) and which
sit on the same rail (the same local index on every node: one NIC each), for owner collectives done
in two levels (runtime/comm.py's ``two_level``). A node is ``global rank // ranks_per_node``, as a
launcher places ranks (torchrun's ``LOCAL_WORLD_SIZE``); ``--mfsdp-ranks-per-node`` overrides it, and
tests simulate a layout (4 gloo ranks as 2 nodes of 2).

A shard group's ranks are taken in group-rank order; every node must hold the same number m of them
and they must lie together (group rank g on node g // m at local index g % m), which holds for any
group of increasing global ranks spread evenly over the nodes. Its groups are built once, at set-up,
collectively on every rank of the world (``dist.new_group`` for every group, in the same order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

FLAG = "--mfsdp-ranks-per-node"


def node_layout(ranks: list[int], ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(nodes, rails) of a shard group's global ``ranks`` (in group-rank order), both as lists of group
    ranks: ``nodes[j]`` the group's ranks on its j-th node, ``rails[l]`` those at local index l of
    every node, in node order. Raises ValueError naming the flag when the group is not spread evenly."""
    if ranks_per_node < 1:
        raise ValueError(f"{FLAG} {ranks_per_node} must be at least 1")
    node_of = [g // ranks_per_node for g in ranks]
    counts = {node: node_of.count(node) for node in node_of}
    m = counts[node_of[0]] if ranks else 1
    if any(c != m for c in counts.values()) or any(node_of[g] != node_of[g - g % m] for g in range(len(ranks))):
        raise ValueError(
            f"{FLAG} {ranks_per_node}: the shard group's ranks {ranks} are not spread evenly over nodes of "
            f"{ranks_per_node} consecutive ranks (each node must hold the same number of them)"
        )
    world = len(ranks)
    nodes = [list(range(j * m, (j + 1) * m)) for j in range(world // m)]
    rails = [list(range(local, world, m)) for local in range(m)]
    return nodes, rails


@dataclass
class NodeLevels:
    """This rank's two levels in one shard group. ``node`` (its node's shard ranks) and ``rail`` (its
    rail's) are process groups, None where the level has one rank (nothing to send on it); group rank g
    of the shard group is on node ``g // per_node`` at local index ``g % per_node``, which is also its
    rank in its node group, and its node index is its rank in its rail group."""

    per_node: int
    """Shard ranks per node (m)."""

    nodes: int
    """Nodes the shard group spans (N; N x m = W)."""

    node: object | None
    rail: object | None

    def where(self, group_rank: int) -> tuple[int, int]:
        """(node, local index) of a shard group rank."""
        return divmod(group_rank, self.per_node)

    @property
    def world(self) -> int:
        return self.per_node * self.nodes


def single_level(shard) -> NodeLevels:
    """Every rank of ``shard`` on one node: its node group is the shard group, and it has no rails."""
    world = dist.get_world_size(shard) if shard is not None else 1
    return NodeLevels(world, 1, shard if world > 1 else None, None)


def build_node_levels(shard, ranks_per_node: int) -> NodeLevels:
    """This rank's levels in ``shard`` (a process group; None: this rank alone), built collectively on
    every rank of the world: each rank's shard group is exchanged, then :func:`new_levels`."""
    if shard is None or dist.get_world_size(shard) == 1:
        return single_level(shard)
    mine = dist.get_process_group_ranks(shard)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return new_levels([tuple(r) for r in everyone], shard, ranks_per_node)


def new_levels(shard_groups: list[tuple[int, ...]], shard, ranks_per_node: int) -> NodeLevels:
    """The node and rail groups of every distinct shard group in ``shard_groups`` (global ranks), created
    in sorted order on every rank of the world (``dist.new_group`` runs on all ranks for every group);
    this rank's levels in ``shard``, its own. A level holding the whole shard group is ``shard`` itself,
    one of a single rank is None: a layout with one node, or one shard rank per node, needs no new group."""
    me, levels = dist.get_rank(), None
    for ranks in sorted(set(shard_groups)):
        nodes, rails = node_layout(list(ranks), ranks_per_node)
        m, n = len(rails), len(nodes)
        made = {}
        for kind, members_list in (
            ("node", nodes if 1 < m < len(ranks) else []),
            ("rail", rails if 1 < n < len(ranks) else []),
        ):
            for members in members_list:
                group = dist.new_group([ranks[g] for g in members])
                if me in [ranks[g] for g in members]:
                    made[kind] = group
        if me in ranks:
            levels = NodeLevels(m, n, shard if n == 1 else made.get("node"), shard if m == 1 else made.get("rail"))
    return levels
