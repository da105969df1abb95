"""The flat-buffer layout of every unit, and the plan that collects them.

A unit's flat buffer is laid out as::

    [ matrix region: rank 0's matrices | rank 1's | ... | rank W-1's ]
    [ tail region:   rank 0's slice    | rank 1's | ... | rank W-1's ]

Matrices (storage WHOLE) lie whole inside their owner's part of the matrix region;
the tail (storage SLICE: norms, biases, embeddings, output layer) is split evenly by
elements. Rank ``r``'s *segment* is its two parts; either may be empty. Each
parameter is contiguous in the full buffer, so after a gather it is a plain view.
Every rank computes the same plan from the same inputs; ``verify.py`` checks that.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .classes import ELEMENTWISE, MATRIX, WHOLE


@dataclass
class ParamSpec:
    """What the planner needs to know of one parameter."""

    name: str
    shape: tuple[int, ...]
    rule: str  # update-rule name
    storage: str  # WHOLE or SLICE
    cost: int = 0  # planner cost (Newton-Schulz flops for Muon), 0 for the tail
    split_rows: tuple[int, ...] | None = None  # rows per group of blocks updated apart (QKV)
    param: str | None = None  # a block of this parameter (Q, K or V placed apart); None: the whole of it
    param_start: int = 0  # the block's first element in the flattened parameter
    param_run: int = 0  # a block is runs of this many elements of the flattened parameter ...
    param_stride: int = 0  # ... whose starts lie this many elements apart (a query group's rows)
    state_bytes: int = 0  # resident optimizer state of its rule (planner memory, with the elements)

    @property
    def param_name(self) -> str:
        return self.param or self.name

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def weight(self) -> int:
        """What the planner balances as memory: the elements, plus the state its rule keeps beyond two
        fp32 words per element (AdamW's moments; Muon keeps one), counted in elements. Muon's and AdamW's
        plans stay what they were by elements; a rule with factors (SOAP, Shampoo) weighs them in."""
        return self.numel + max(0, self.state_bytes - 8 * self.numel) // 4


@dataclass
class UnitSpec:
    name: str
    params: list[ParamSpec]


@dataclass
class ParamSlot:
    """A parameter's place in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    rule: str
    storage: str
    offset: int  # into the unit's full buffer
    numel: int
    owner: int  # owning DP rank of a WHOLE parameter, -1 for the evenly split tail
    split_rows: tuple[int, ...] | None = None
    param: str | None = None  # as ParamSpec: the parameter this slot is a row block of, None for all of it
    param_start: int = 0  # the block's first element in the flattened parameter
    param_run: int = 0
    param_stride: int = 0

    @property
    def param_name(self) -> str:
        return self.param or self.name

    def runs(self) -> tuple[int, int, int, int]:
        """(first element in the flattened parameter, run, stride, count): the parameter's elements
        this slot holds are ``count`` runs of ``run`` elements, ``stride`` apart, in slot order (one
        run for a whole parameter or a block of one query group, one per group where groups
        interleave Q, K and V)."""
        if self.param is None:
            return 0, self.numel, self.numel, 1
        return self.param_start, self.param_run, self.param_stride, self.numel // self.param_run


@dataclass
class LocalPiece:
    """The part of one parameter held in this rank's segment."""

    slot: ParamSlot
    segment_offset: int  # into this rank's segment
    param_offset: int  # into the flattened parameter (a block's first element, for a block slot: whole on its owner)
    numel: int

    def runs(self) -> tuple[int, int, int, int]:
        """As :meth:`ParamSlot.runs`, for the elements of the parameter this piece holds."""
        if self.slot.param is None:
            return self.param_offset, self.numel, self.numel, 1
        return self.slot.runs()


@dataclass
class UnitLayout:
    index: int
    name: str
    world_size: int
    slots: list[ParamSlot]
    matrix_numel: int
    tail_numel: int
    matrix_bounds: list[int]  # W+1 offsets into the matrix region
    tail_bounds: list[int]  # W+1 offsets into the tail region

    @property
    def numel(self) -> int:
        return self.matrix_numel + self.tail_numel

    def matrix_range(self, rank: int) -> tuple[int, int]:
        """Rank's part of the matrix region, as offsets into the full buffer."""
        return self.matrix_bounds[rank], self.matrix_bounds[rank + 1]

    def tail_range(self, rank: int) -> tuple[int, int]:
        """Rank's part of the tail region, as offsets into the full buffer."""
        return (self.matrix_numel + self.tail_bounds[rank], self.matrix_numel + self.tail_bounds[rank + 1])

    def segment_numel(self, rank: int) -> int:
        (a, b), (c, d) = self.matrix_range(rank), self.tail_range(rank)
        return (b - a) + (d - c)

    def segment_numels(self) -> list[int]:
        """``segment_numel`` of every rank in one pass over the bounds (plans sum it over every unit)."""
        mb, tb = self.matrix_bounds, self.tail_bounds
        return [(m1 - m0) + (t1 - t0) for m0, m1, t0, t1 in zip(mb, mb[1:], tb, tb[1:])]

    def param_bounds(self, slot: ParamSlot) -> list[int]:
        """W+1 offsets into the flattened parameter: rank r's segment holds [b[r], b[r + 1]) of it
        (the whole of it on its owner for WHOLE storage, an even slice's overlap for the tail)."""
        bounds = [0]
        for r in range(self.world_size):
            _, hi = self.matrix_range(r) if slot.storage == WHOLE else self.tail_range(r)
            bounds.append(max(0, min(slot.numel, hi - slot.offset)))
        return bounds

    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """Which parameter elements rank's segment holds, in segment order."""
        m0, m1 = self.matrix_range(rank)
        t0, t1 = self.tail_range(rank)
        pieces = []
        for start, end, seg_base in ((m0, m1, 0), (t0, t1, m1 - m0)):
            for slot in self.slots:
                lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    at = slot.param_start + lo - slot.offset
                    pieces.append(LocalPiece(slot, seg_base + lo - start, at, hi - lo))
        return pieces


@dataclass
class Plan:
    world_size: int
    policy: str
    units: list[UnitLayout]
    cost_per_rank: list[int]  # planner cost (NS multiply-adds per optimizer step) of each rank's matrices
    element_size: int = 4
    extra_per_rank: list[int] | None = None  # matrices' state beyond one fp32 word per element, in elements
    collectives: object | None = field(default=None, compare=False)
    """Each unit's owner-collective algorithms (placement/collectives.py CollectivePlan), once chosen."""

    def digest(self) -> str:
        """A hash of everything that decides the layout; equal on every rank or training is wrong. A
        checkpoint compares it, so the collective algorithms (which move the same elements) stay out."""
        units = [asdict(u) for u in self.units]
        for unit in units:  # a slot that is a whole parameter hashes as before blocks existed
            for slot in unit["slots"]:
                if slot["param"] is None:
                    del slot["param"], slot["param_start"], slot["param_run"], slot["param_stride"]
                slot["rule"] = legacy_rule_name(slot["rule"], slot["storage"])
        payload = json.dumps({"world_size": self.world_size, "units": units}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def agreement_digest(self) -> str:
        """What every rank of a group must compute alike: the layout and, once chosen, the collective
        algorithms (ranks that chose differently would issue different collectives and hang)."""
        if self.collectives is None:
            return self.digest()
        return hashlib.sha256(f"{self.digest()}|{self.collectives.digest()}".encode()).hexdigest()

    def per_rank_weight(self) -> list[int]:
        """Per rank, what the planner balances as memory: owned elements plus extra state (ParamSpec.weight)."""
        elements, _ = self.per_rank_load()
        return [e + x for e, x in zip(elements, self.extra_per_rank or [0] * self.world_size)]

    def per_rank_load(self) -> tuple[list[int], list[int]]:
        """(owned elements, planner cost) per rank."""
        elements = [0] * self.world_size
        for unit in self.units:
            for r, n in enumerate(unit.segment_numels()):
                elements[r] += n
        return elements, list(self.cost_per_rank)

    def report(self) -> str:
        """A printable table: owned bytes and Newton-Schulz flops per rank, with max/mean. Every rank
        up to FULL_TABLE_MAX_RANKS; above, the ranks at either end of the NS-flops order and
        histograms (a table of W rows hides the few ranks that matter among the many)."""
        elements, costs = self.per_rank_load()
        nbytes = [e * self.element_size for e in elements]
        blocked = {slot.param for unit in self.units for slot in unit.slots if slot.param is not None}
        apart = f", Q/K/V apart in {len(blocked)} linear_qkv" if blocked else ""
        owned = [0] * self.world_size
        for unit in self.units:
            for slot in unit.slots:
                if slot.owner >= 0:
                    owned[slot.owner] += 1
        lines = [
            f"MatrixFSDP plan: {len(self.units)} units over {self.world_size} DP ranks, policy {self.policy}{apart}"
        ]
        rows = [f"{r:>6} {nbytes[r]:>14,} {2 * costs[r]:>16,} {owned[r]:>9}" for r in range(self.world_size)]
        header = f"{'rank':>6} {'owned bytes':>14} {'NS flops/step':>16} {'matrices':>9}"
        if self.world_size <= FULL_TABLE_MAX_RANKS:
            lines += [header, *rows]
        else:
            lines += _summary(rows, nbytes, costs, header)
        lines.append(f"max/mean: bytes {balance(nbytes):.3f}, NS flops {balance(costs):.3f}")
        if self.collectives is not None:
            lines.append(self.collectives.report())
        return "\n".join(lines)


FULL_TABLE_MAX_RANKS = 16
"""Plan.report lists every DP rank up to this many (a screenful); above, SHOWN_AT_EACH_END ranks
at each end of the NS-flops order and HISTOGRAM_BINS-bin histograms of load / mean."""
SHOWN_AT_EACH_END = 4
HISTOGRAM_BINS = 10


def _summary(rows: list[str], nbytes: list[int], costs: list[int], header: str) -> list[str]:
    """The ranks with the most and the least Newton-Schulz flops (the optimizer step waits for the
    busiest; owned bytes break ties, then rank), and histograms of both loads over all ranks."""
    world, k = len(rows), SHOWN_AT_EACH_END
    order = sorted(range(world), key=lambda r: (-costs[r], -nbytes[r], r))
    return [
        f"the {k} DP ranks with the most NS flops/step and the {k} with the least, of {world} "
        f"(owned bytes break ties; every rank is listed at W <= {FULL_TABLE_MAX_RANKS})",
        header,
        *(rows[r] for r in order[:k]),
        f"{'...':>6} ({world - 2 * k} ranks between)",
        *(rows[r] for r in order[-k:]),
        load_histogram("NS flops", costs),
        load_histogram("owned bytes", nbytes),
    ]


def histogram_counts(values: Sequence[float], bins: int = HISTOGRAM_BINS) -> tuple[float, float, list[int]]:
    """(lowest, highest, counts) of value / mean in ``bins`` equal bins from the lowest to the
    highest; the highest value falls in the last bin, and all in the first when they are equal."""
    mean = sum(values) / len(values)
    ratios = [v / mean if mean > 0 else 1.0 for v in values]
    lo, hi = min(ratios), max(ratios)
    width = (hi - lo) / bins
    counts = [0] * bins
    for x in ratios:
        counts[min(int((x - lo) / width), bins - 1) if width > 0 else 0] += 1
    return lo, hi, counts


def load_histogram(label: str, values: Sequence[float]) -> str:
    """One line: how many ranks fall in each of HISTOGRAM_BINS equal bins of load / mean."""
    lo, hi, counts = histogram_counts(values)
    return (
        f"histogram of {label} / mean over {len(values)} ranks, {len(counts)} equal bins from {lo:.3f} to "
        f"{hi:.3f}: " + " ".join(str(c) for c in counts)
    )


def legacy_rule_name(rule: str, storage: str) -> str:
    """Before roles, placement tagged a model's matrices with the rule 'muon' ('muon_even' as even
    slices) and everything else with 'adamw'; digests hash these names so that a plan made then and
    now digests alike (--ckpt-format torch checkpoints compare digests)."""
    if rule == MATRIX:
        return "muon" if storage == WHOLE else "muon_even"
    return "adamw" if rule == ELEMENTWISE else rule


def balance(values: Sequence[float]) -> float:
    """max/mean; 1.0 is perfect. Defined as 1.0 when everything is zero."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def even_bounds(numel: int, world_size: int) -> list[int]:
    """W+1 offsets splitting ``numel`` elements evenly; the first ``numel % W`` ranks get one more."""
    base, extra = divmod(numel, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def _slot(p: ParamSpec, offset: int, owner: int) -> ParamSlot:
    block = (p.param, p.param_start, p.param_run, p.param_stride)
    return ParamSlot(p.name, tuple(p.shape), p.rule, p.storage, offset, p.numel, owner, p.split_rows, *block)


def layout_units(units: Sequence[UnitSpec], world_size: int, owners: dict[str, int], policy: str) -> Plan:
    """Lay out every unit given the owner of each WHOLE parameter."""
    layouts = []
    cost, extra = [0] * world_size, [0] * world_size
    for index, unit in enumerate(units):
        matrices = [p for p in unit.params if p.storage == WHOLE]
        tail = [p for p in unit.params if p.storage != WHOLE]
        slots, offset, bounds = [], 0, [0]
        for r in range(world_size):
            for p in matrices:  # model order within an owner
                if owners[p.name] == r:
                    slots.append(_slot(p, offset, r))
                    offset += p.numel
                    cost[r] += p.cost
                    extra[r] += p.weight - p.numel
            bounds.append(offset)
        matrix_numel = offset
        for p in tail:
            slots.append(_slot(p, offset, -1))
            offset += p.numel
        tail_numel = offset - matrix_numel
        layouts.append(
            UnitLayout(
                index,
                unit.name,
                world_size,
                slots,
                matrix_numel,
                tail_numel,
                bounds,
                even_bounds(tail_numel, world_size),
            )
        )
    return Plan(world_size, policy, layouts, cost, extra_per_rank=extra)
