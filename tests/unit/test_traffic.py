"""The link-byte table (runtime/traffic.py) against hand-counted NCCL rings, and the rank-ordered
chain's schedule (runtime/chain.py): each rank's own hops are the chain's, every contribution is
added exactly once in rank order, and no rank moves more than a unit plus its own segment."""

import pytest

from megatron_mfsdp.runtime.chain import ADD, KEEP, chain_hops, chain_links, rank_hops
from megatron_mfsdp.runtime.traffic import all_reduce_link, broadcast_link, reduce_link, slices_link


def test_ring_charges_per_rank_as_counted_by_hand():
    # Broadcast of 100 bytes from rank 2 over 4 ranks, ring 2 -> 3 -> 0 -> 1: 1 is the ring's last.
    assert [broadcast_link(100, r, 2, 4) for r in range(4)] == [(100, 100), (100, 0), (0, 100), (100, 100)]
    # Reduce into 2: the mirror, ring 1 -> 0 -> 3 -> 2, so 1 only sends.
    assert [reduce_link(100, r, 2, 4) for r in range(4)] == [(100, 100), (0, 100), (100, 0), (100, 100)]
    assert slices_link(25, 4) == (75, 75)  # all-gather / reduce-scatter of 4 slices of 25
    assert all_reduce_link(100, 4) == (150, 150)  # 2 (W - 1) / W
    assert broadcast_link(100, 0, 0, 1) == (0, 0) and all_reduce_link(100, 1) == (0, 0)
    # Control: an owner sending its 100 bytes to each peer in turn (the older p2p gather) would be
    # charged 300 out on the owner; the ring keeps every rank at one copy each way.
    assert max(max(broadcast_link(100, r, 0, 4)) for r in range(4)) == 100


@pytest.mark.parametrize("world", range(1, 10))
def test_each_rank_finds_its_own_hops_without_walking_the_chain(world):
    for owner in range(world):
        hops = chain_hops(world, owner)
        for rank in range(world):
            assert rank_hops(world, owner, rank) == [h for h in hops if rank in h[:2]], (world, owner, rank)


@pytest.mark.parametrize("world", range(2, 10))
def test_chain_adds_every_contribution_once_in_rank_order_and_ends_at_the_owner(world):
    for owner in range(world):
        held = {r: [r] for r in range(world)}  # the contributions each rank's buffer holds, in sum order
        kept = None
        for src, dst, action in chain_hops(world, owner):
            if action == ADD:  # the receiver adds its own into what it got: partial + own
                held[dst] = held[src] + [dst] if held[src][0] < dst else [dst] + held[src]
            else:
                assert dst == owner
                kept = held[src]
        final = kept if kept is not None else held[owner]
        assert final == list(range(world)), (world, owner, final)
        # Every link is a distinct sender: no rank sends a part twice, so no fan-out.
        senders = [src for src, _, _ in chain_hops(world, owner)]
        assert len(senders) == len(set(senders)) or (owner not in (0, world - 1) and senders.count(world - 1) == 1)


def test_chain_bytes_stay_within_a_unit_plus_the_owners_segment():
    world, n = 8, 1000
    for owner in range(world):
        links = chain_links([(owner, 0, n)], None, world, elsize=1)
        assert max(out for _, out in links) <= n
        assert max(i for i, _ in links) <= 2 * n
        # only a middle owner (not 0, 1 or the last) receives its part twice
        assert (max(i for i, _ in links) == 2 * n) == (owner not in (0, 1, world - 1)), owner
    # The tail: one padded pass in rank order, then one slice to each rank from the last.
    links = chain_links([], (0, [3, 3, 2, 2]), 4, elsize=1)
    assert links == [(3, 12), (12 + 3, 12), (12 + 2, 12), (12, 3 + 3 + 2)]
    assert KEEP in {a for _, _, a in chain_hops(4, 2)} and KEEP not in {a for _, _, a in chain_hops(4, 3)}
