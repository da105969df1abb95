"""The node layout of a shard group (node_levels.py): nodes of consecutive global ranks, rails of one
local index each, and a clear error naming the flag where a group is not spread evenly."""

import pytest

from megatron_mfsdp.node_levels import node_layout


def test_nodes_and_rails_of_a_contiguous_and_a_strided_group():
    assert node_layout([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # DP ranks at TP 2 (global 0, 2, ..., 14) on nodes of 8: 4 shard ranks per node
    assert node_layout(list(range(0, 16, 2)), 8) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert node_layout([0, 8, 16, 24], 8) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])  # TP 8: one per node
    assert node_layout([0, 1, 2, 3], 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])  # one node


def test_a_group_spread_unevenly_names_the_flag():
    with pytest.raises(ValueError, match="--mfsdp-ranks-per-node 3: the shard group's ranks"):
        node_layout([0, 2, 4, 6, 8, 10], 3)  # nodes 0, 0, 1, 2, 2, 3
    with pytest.raises(ValueError, match="--mfsdp-ranks-per-node 0 must be at least 1"):
        node_layout([0, 1], 0)


def test_the_flag_defaults_to_the_launcher_and_checks_the_shard_groups(monkeypatch):
    from megatron_mfsdp.training.arguments import parse_args
    from tests.launch import TINY

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert parse_args(TINY + ["--use-matrix-fsdp"], world_size=4).mfsdp_ranks_per_node == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert parse_args(TINY + ["--use-matrix-fsdp"], world_size=4).mfsdp_ranks_per_node == 4
