"""The rank-ordered reduction (``--mfsdp-reduce-order rank``): bitwise the single-process sum.

The reference (testing/reference.py) adds the W ranks' contributions in rank order, in fp32:
``((c0 + c1) + c2) + ...``. A ring reduce sums in the ring's order, and an owner that receives
every peer's copy (an all-to-all) pays W - 1 copies of its segment on one link. Here the partial
sum of each owner part travels from rank to rank in rank order instead, each rank adding its own
contribution in fp32, and the last one hands the sum to the owner. Every rank sends about one unit
and receives about one unit, whatever the owners' split; an owner in the middle of the chain also
receives its own parts' sums (at most its segment more), since no rank-ordered chain can end
there without passing it twice. Parts go in chunks so the chain pipelines. Addition is commutative
in IEEE arithmetic (``c + P == P + c`` bit for bit), so each rank adds the received partial into
its own contribution in place.

The hops of a matrix part owned by ``o`` (``r -> s``: r sends what it holds, s adds its own or
keeps the finished sum):

    o = W - 1:        0 -> 1 -> ... -> W-1
    o = 0, W = 2:     1 -> 0                         (0 adds c1 to c0)
    o = 1, W >= 3:    1 -> 0 -> 2 -> ... -> W-1 -> 1  (0 adds c1 to c0: the reference's first sum)
    otherwise:        0 -> 1 -> ... -> W-1 -> o      (o receives the finished sum)

The evenly split tail (W slices, one per rank) goes as one part, 0 -> 1 -> ... -> W-1, and rank
W - 1 then hands each rank its slice: one message a rank instead of one a slice.

Every rank walks the parts, chunks and hops in the same order, acting on the hops it is an end of
(at most three a part, found without walking the chain) and waiting only on what it receives, so
the earliest unfinished hop always has both ends at it: the chain cannot deadlock, and on NCCL no
receive is queued ahead of a send it depends on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ADD, KEEP = "add", "keep"  # what the receiver of a hop does: add its own contribution, or keep the sum

CHUNK_BYTES = 4 << 20
"""Bytes of fp32 partial sums per message: a part of n bytes goes in ceil(n / CHUNK_BYTES) chunks,
so the chain's W hops overlap instead of running one after another."""


def chain_hops(world: int, owner: int) -> list[tuple[int, int, str]]:
    """Every hop (sender, receiver, what the receiver does), in order, that sums a part owned by ``owner``."""
    if world == 1:
        return []
    links = [(r, r + 1, ADD) for r in range(world - 1)]
    if owner == world - 1:
        return links
    if owner == 0 and world == 2:
        return [(1, 0, ADD)]
    if owner == 1:
        return [(1, 0, ADD), (0, 2, ADD)] + links[2:] + [(world - 1, 1, KEEP)]
    return links + [(world - 1, owner, KEEP)]


def rank_hops(world: int, owner: int, rank: int) -> list[tuple[int, int, str]]:
    """The hops of :func:`chain_hops` that ``rank`` sends or receives, in chain order, without building
    the chain (a rank of a 1024-rank group would otherwise walk 1024 hops per part)."""
    if world == 1:
        return []
    if owner == 0 and world == 2:
        return [(1, 0, ADD)]
    pred, succ = rank - 1, rank + 1  # the plain links around this rank
    if owner == 1 and world >= 3:  # 1 -> 0 -> 2 -> ...: ranks 0, 1 and 2 are linked differently
        pred = {0: 1, 1: None, 2: 0}.get(rank, pred)
        succ = {0: 2, 1: 0}.get(rank, succ)
    hops = [(pred, rank, ADD)] if pred is not None and pred >= 0 else []
    hops += [(rank, succ, ADD)] if succ < world else []
    if owner != world - 1 and rank == world - 1:
        hops.append((world - 1, owner, KEEP))
    elif owner != world - 1 and rank == owner:
        hops.append((world - 1, owner, KEEP))
    return hops


def chunks(first: int, end: int, chunk: int):
    """[a, b) ranges of at most ``chunk`` elements covering [first, end)."""
    for a in range(first, end, chunk):
        yield a, min(end, a + chunk)


def chain_links(parts, tail, world: int, elsize: int = 4) -> list[tuple[int, int]]:
    """(in, out) of every rank for one rank-ordered reduction: ``parts`` ((owner, first, end) of the
    matrix region), ``tail`` ((first, [slice lengths])) or None; partial sums of ``elsize`` bytes."""
    links = [[0, 0] for _ in range(world)]
    for owner, lo, hi in parts:
        for src, dst, _ in chain_hops(world, owner):
            links[src][1] += (hi - lo) * elsize
            links[dst][0] += (hi - lo) * elsize
    if tail is not None and world > 1:
        padded = max(tail[1]) * world * elsize
        for r in range(world - 1):
            links[r][1] += padded
            links[r + 1][0] += padded
            links[world - 1][1] += tail[1][r] * elsize
            links[r][0] += tail[1][r] * elsize
    return [tuple(link) for link in links]


class Chain:
    """One rank's side of a rank-ordered reduction of a unit.

    ``work``: this rank's fp32 contribution, summed into in place; ``parts``: (owner, first, end) of
    the matrix region in its coordinates, summed into ``result`` (this rank's segment) from 0 where
    this rank owns one; ``tail``: (first, [slice length per rank]) of the padded tail, rank r's slice
    at ``first + r * max(lengths)``, landing in ``result`` after the matrix part. ``moved`` counts
    (bytes in, bytes out) where each message is posted."""

    def __init__(self, work: torch.Tensor, parts, tail, rank: int, world: int, group, result, chunk_bytes: int):
        self.work, self.parts, self.tail, self.rank, self.world = work, parts, tail, rank, world
        self.group, self.result = group, result
        self.chunk = max(1, chunk_bytes // work.element_size())
        self.sends, self.moved, self._tmp = [], [0, 0], None
        self.own = sum(hi - lo for owner, lo, hi in parts if owner == rank)  # where the tail slice lands

    def run(self) -> torch.Tensor:
        """Sum every part and the tail; return ``result`` once everything is sent and received."""
        for owner, lo, hi in self.parts:
            self._part(rank_hops(self.world, owner, self.rank), owner, lo, hi)
        if self.tail is not None:
            self._tail(*self.tail)
        for send in self.sends:  # the sends read ``work``: done before it is dropped
            send.wait()
        return self.result

    def _part(self, hops, owner: int, lo: int, hi: int) -> None:
        for a, b in chunks(lo, hi, self.chunk):
            for src, dst, action in hops:
                if src == self.rank:
                    self._send(self.work[a:b], dst)
                elif action == ADD:
                    self._add(a, b, src)
                else:
                    self._recv(self.result[a - lo : b - lo], src)
            if owner == self.rank and hops[-1][2] == ADD:  # this rank added last: the sum is here
                self.result[a - lo : b - lo].copy_(self.work[a:b])

    def _tail(self, first: int, lengths: list[int]) -> None:
        """The tail in rank order, then each rank's slice from the last rank."""
        s, last = max(lengths), self.world - 1
        for a, b in chunks(first, first + s * self.world, self.chunk):
            if self.rank > 0:
                self._add(a, b, self.rank - 1)
            if self.rank < last:
                self._send(self.work[a:b], self.rank + 1)
        mine = self.result[self.own : self.own + lengths[self.rank]]
        if self.rank == last:
            mine.copy_(self.work[first + last * s : first + last * s + lengths[last]])
            for r in range(last):
                self._send(self.work[first + r * s : first + r * s + lengths[r]], r)
        else:
            self._recv(mine, last)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        if t.numel():
            self.sends.append(dist.isend(t, group=self.group, group_dst=dst))
            self.moved[1] += t.numel() * t.element_size()

    def _recv(self, t: torch.Tensor, src: int) -> None:
        if t.numel():
            dist.irecv(t, group=self.group, group_src=src).wait()
            self.moved[0] += t.numel() * t.element_size()

    def _add(self, a: int, b: int, src: int) -> None:
        if self._tmp is None or self._tmp.numel() < b - a:
            self._tmp = torch.empty(b - a, dtype=self.work.dtype, device=self.work.device)
        tmp = self._tmp[: b - a]
        self._recv(tmp, src)
        self.work[a:b].add_(tmp)  # own + partial: the reference's partial + own, bit for bit
