"""pretrain_gpt.py with each owner-collective algorithm forced (--mfsdp-collectives) at W = 4 on a simulated
layout of 2 ranks per node (--mfsdp-ranks-per-node 2): the losses of one rank within a stated tolerance.
``parts`` in rank order is the exact chain (bitwise, tests/distributed/test_dp_exactness.py); ``two-level``
sums each node's gradients, then across nodes, and ``padded`` sums in gloo's reduce-scatter order, so these
differ from one rank in the last bits of each step's gradient (measured below 1e-6 in the losses)."""

import pytest

from tests.launch import TINY, pretrain_in_workers, train_losses

MFSDP = ["--use-matrix-fsdp"]  # TINY's global batch 8 of micro-batches of 2: one per rank at W = 4


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return train_losses(pretrain_in_workers(1, *TINY, *MFSDP, tmp_path=tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("algorithm", ["two-level", "padded"])
def test_forced_algorithm_at_w4_in_nodes_of_two_trains_as_one_rank(algorithm, one_rank, tmp_path):
    flags = ["--mfsdp-collectives", algorithm, "--mfsdp-ranks-per-node", "2"]
    ranks = pretrain_in_workers(4, *TINY, *MFSDP, *flags, tmp_path=tmp_path, rank=None)
    four = train_losses(ranks[-1])
    worst = max(abs(a - b) for a, b in zip(four, one_rank))
    print(f"\n--mfsdp-collectives {algorithm} at W 4 (2 per node) against one rank: losses within {worst:.2e}")
    assert len(four) == len(one_rank) and worst <= 1e-5, (four, one_rank)
    assert f"gather {algorithm.replace('-', '_')}" in ranks[0]["stdout"]  # the plan table says what runs
