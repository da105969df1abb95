"""Placement: which optimizer each parameter gets, how parameters group into
units, and which data-parallel rank owns what.

Every rank computes the same plan from the same inputs; nothing here talks to
other ranks except :func:`verify_plan_agreement`, which compares digests.

A unit's flat buffer is laid out as::

    [ matrix region: rank 0's matrices | rank 1's | ... | rank W-1's ]
    [ tail region:   rank 0's slice    | rank 1's | ... | rank W-1's ]

Muon matrices lie whole inside their owner's part of the matrix region; the
AdamW tail (norms, biases, embeddings, output layer) is split evenly by
elements. Rank ``r``'s *segment* is its two parts; either may be empty. Each
parameter is contiguous in the full buffer, so after a gather it is a plain
view.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

MUON = "muon"
ADAMW = "adamw"

# First match wins; user rules are tried before these. The names are
# megatron-core's GPT parameter names (local and Transformer Engine specs).
DEFAULT_PARAM_RULES: Tuple[Tuple[str, str], ...] = (
    ("*embedding*", ADAMW),
    ("*output_layer.*", ADAMW),
    ("*.bias", ADAMW),
    ("*layer_norm_weight", ADAMW),  # TE: norm fused into the linear layer
    ("*layer_norm_bias", ADAMW),
    ("*norm*.weight", ADAMW),  # input/pre_mlp/final layernorm, q/k layernorm, RMSNorm
    ("*linear_qkv.weight", MUON),
    ("*linear_proj.weight", MUON),
    ("*linear_fc1.weight", MUON),
    ("*linear_fc2.weight", MUON),
)


def classify_parameter(name: str, shape: Sequence[int], user_rules: Sequence[Tuple[str, str]] = ()) -> str:
    """Return MUON or ADAMW for one parameter; raise if no rule matches or a
    non-matrix is sent to Muon."""
    for pattern, kind in list(user_rules) + list(DEFAULT_PARAM_RULES):
        if fnmatch.fnmatchcase(name, pattern):
            if kind == MUON and len(shape) != 2:
                raise ValueError(
                    f"parameter {name!r} of shape {tuple(shape)} matches Muon rule {pattern!r}, "
                    "but Muon needs a 2D matrix; add --mfsdp-param-rule '{name}=adamw'"
                )
            return kind
    raise ValueError(
        f"parameter {name!r} of shape {tuple(shape)} fits no placement rule; "
        f"add --mfsdp-param-rule '{name}=muon' or '{name}=adamw'"
    )


def newton_schulz_cost(shape: Sequence[int], block_rows: Optional[Sequence[int]] = None) -> int:
    """Flops-proportional cost of one Newton-Schulz iteration, m*n*min(m,n),
    summed over the blocks that are orthogonalized separately (Q, K, V)."""
    rows, cols = shape
    blocks = block_rows or [rows]
    return sum(r * cols * min(r, cols) for r in blocks)


@dataclass
class ParamSpec:
    """What the planner needs to know of one parameter."""

    name: str
    shape: Tuple[int, ...]
    kind: str
    ns_cost: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class UnitSpec:
    name: str
    params: List[ParamSpec]


@dataclass
class ParamSlot:
    """A parameter's place in its unit's flat buffer."""

    name: str
    shape: Tuple[int, ...]
    kind: str
    offset: int  # into the unit's full buffer
    numel: int
    owner: int  # owning DP rank for Muon matrices, -1 for the evenly split tail


@dataclass
class LocalPiece:
    """The part of one parameter held in this rank's segment."""

    slot: ParamSlot
    segment_offset: int  # into this rank's segment
    param_offset: int  # into the flattened parameter
    numel: int


@dataclass
class UnitLayout:
    index: int
    name: str
    world_size: int
    slots: List[ParamSlot]
    matrix_numel: int
    tail_numel: int
    matrix_bounds: List[int]  # W+1 offsets into the matrix region
    tail_bounds: List[int]  # W+1 offsets into the tail region

    @property
    def numel(self) -> int:
        return self.matrix_numel + self.tail_numel

    def matrix_range(self, rank: int) -> Tuple[int, int]:
        """Rank's part of the matrix region, as offsets into the full buffer."""
        return self.matrix_bounds[rank], self.matrix_bounds[rank + 1]

    def tail_range(self, rank: int) -> Tuple[int, int]:
        """Rank's part of the tail region, as offsets into the full buffer."""
        return (self.matrix_numel + self.tail_bounds[rank], self.matrix_numel + self.tail_bounds[rank + 1])

    def segment_numel(self, rank: int) -> int:
        (a, b), (c, d) = self.matrix_range(rank), self.tail_range(rank)
        return (b - a) + (d - c)

    def local_pieces(self, rank: int) -> List[LocalPiece]:
        """Which parameter elements rank's segment holds, in segment order."""
        m0, m1 = self.matrix_range(rank)
        t0, t1 = self.tail_range(rank)
        pieces = []
        for start, end, seg_base in ((m0, m1, 0), (t0, t1, m1 - m0)):
            for slot in self.slots:
                lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    pieces.append(LocalPiece(slot, seg_base + lo - start, lo - slot.offset, hi - lo))
        return pieces


@dataclass
class Plan:
    world_size: int
    policy: str
    units: List[UnitLayout]
    ns_cost_per_rank: List[int]  # Newton-Schulz cost of each rank's owned matrices
    element_size: int = 4

    def digest(self) -> str:
        """A hash of everything that decides the layout; equal on every rank or training is wrong."""
        payload = json.dumps(
            {"world_size": self.world_size, "units": [asdict(u) for u in self.units]}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def per_rank_load(self) -> Tuple[List[int], List[int]]:
        """(owned elements, Newton-Schulz cost) per rank."""
        elements = [0] * self.world_size
        for unit in self.units:
            for r in range(self.world_size):
                elements[r] += unit.segment_numel(r)
        return elements, list(self.ns_cost_per_rank)

    def report(self) -> str:
        """A printable table: owned bytes and Newton-Schulz flops per rank, with max/mean."""
        elements, costs = self.per_rank_load()
        nbytes = [e * self.element_size for e in elements]
        lines = [f"MatrixFSDP plan: {len(self.units)} units over {self.world_size} DP ranks, policy {self.policy}",
                 f"{'rank':>6} {'owned bytes':>14} {'NS flops/iter':>16} {'matrices':>9}"]
        owned = [0] * self.world_size
        for unit in self.units:
            for slot in unit.slots:
                if slot.owner >= 0:
                    owned[slot.owner] += 1
        for r in range(self.world_size):
            lines.append(f"{r:>6} {nbytes[r]:>14,} {2 * costs[r]:>16,} {owned[r]:>9}")
        lines.append(f"max/mean: bytes {balance(nbytes):.3f}, NS flops {balance(costs):.3f}")
        return "\n".join(lines)


def balance(values: Sequence[float]) -> float:
    """max/mean; 1.0 is perfect. Defined as 1.0 when everything is zero."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _assign_owners(matrices: List[ParamSpec], world_size: int, cost_load: List[float],
                   bytes_load: List[float], total_cost: float, total_bytes: float) -> Dict[str, int]:
    """Largest first: each matrix goes to the rank whose normalized load
    (cost share + element share) after taking it is smallest; ties go to the lower rank."""
    owners = {}
    order = sorted(matrices, key=lambda p: (-p.ns_cost, -p.numel, p.name))
    for p in order:
        def score(r):
            return (cost_load[r] + p.ns_cost) / max(total_cost, 1) + (bytes_load[r] + p.numel) / max(total_bytes, 1)

        r = min(range(world_size), key=lambda r: (score(r), r))
        owners[p.name] = r
        cost_load[r] += p.ns_cost
        bytes_load[r] += p.numel
    return owners


def _even_bounds(numel: int, world_size: int) -> List[int]:
    base, extra = divmod(numel, world_size)
    bounds = [0]
    for r in range(world_size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def _layout_units(units: Sequence[UnitSpec], world_size: int, owners: Dict[str, int], policy: str) -> Plan:
    layouts = []
    ns_cost = [0] * world_size
    for index, unit in enumerate(units):
        matrices = [p for p in unit.params if p.kind == MUON]
        tail = [p for p in unit.params if p.kind == ADAMW]
        slots, offset, bounds = [], 0, [0]
        for r in range(world_size):
            for p in matrices:  # model order within an owner
                if owners[p.name] == r:
                    slots.append(ParamSlot(p.name, tuple(p.shape), MUON, offset, p.numel, r))
                    offset += p.numel
                    ns_cost[r] += p.ns_cost
            bounds.append(offset)
        matrix_numel = offset
        for p in tail:
            slots.append(ParamSlot(p.name, tuple(p.shape), ADAMW, offset, p.numel, -1))
            offset += p.numel
        tail_numel = offset - matrix_numel
        layouts.append(UnitLayout(index, unit.name, world_size, slots, matrix_numel, tail_numel,
                                  bounds, _even_bounds(tail_numel, world_size)))
    return Plan(world_size, policy, layouts, ns_cost)


def plan_units(units: Sequence[UnitSpec], world_size: int, policy: str = "auto") -> Plan:
    """Assign every Muon matrix an owner among ``world_size`` DP ranks and lay out each unit.

    'greedy' walks the units in order and carries each rank's load across them, so
    consecutive units spread their owners; 'global' sorts all matrices at once, which
    balances better when matrix sizes differ a lot across units; 'auto' keeps
    whichever has the smaller worst max/mean of bytes and NS cost.
    """
    if world_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {world_size}")
    names = [p.name for u in units for p in u.params]
    if len(set(names)) != len(names):
        raise ValueError("a parameter appears in two units")
    if policy == "auto":
        candidates = [plan_units(units, world_size, p) for p in ("greedy", "global")]
        return min(candidates, key=lambda plan: max(balance(v) for v in plan.per_rank_load()))
    all_params = [p for u in units for p in u.params]
    tail_total = sum(p.numel for p in all_params if p.kind == ADAMW)
    total_cost = sum(p.ns_cost for p in all_params if p.kind == MUON)
    total_bytes = sum(p.numel for p in all_params)
    # Every rank carries an even share of the tail from the start.
    cost_load = [0.0] * world_size
    bytes_load = [tail_total / world_size] * world_size
    owners: Dict[str, int] = {}
    if policy == "greedy":
        for unit in units:
            owners.update(_assign_owners([p for p in unit.params if p.kind == MUON], world_size,
                                         cost_load, bytes_load, total_cost, total_bytes))
    elif policy == "global":
        owners = _assign_owners([p for p in all_params if p.kind == MUON], world_size,
                                cost_load, bytes_load, total_cost, total_bytes)
    else:
        raise ValueError(f"unknown planner policy {policy!r} (--mfsdp-planner); choose greedy, global or auto")
    return _layout_units(units, world_size, owners, policy)


def verify_plan_agreement(plan: Plan, group) -> None:
    """Compare the plan digest across the group; raise naming the ranks that disagree."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, plan.digest(), group=group)
    if len(set(digests)) != 1:
        by_digest: Dict[str, List[int]] = {}
        for r, d in enumerate(digests):
            by_digest.setdefault(d, []).append(r)
        groups = "; ".join(f"ranks {ranks}: {d[:12]}" for d, ranks in by_digest.items())
        raise RuntimeError(
            "MatrixFSDP ranks computed different placement plans (different models, parameter "
            f"rules or planner settings per rank?): {groups}"
        )


# ----------------------------------------------------------------------------
# Units of a megatron-core GPT model chunk.
# ----------------------------------------------------------------------------

@dataclass
class ModelUnit:
    """A unit of a model: its parameters, and the modules around whose forward
    it must be materialized (acquired before the first, released after the last)."""

    name: str
    params: List[Tuple[str, torch.nn.Parameter]]
    modules: List[torch.nn.Module]
    extra_sites: List[torch.nn.Module] = field(default_factory=list)  # e.g. a tied output layer


def gpt_model_units(model: torch.nn.Module) -> List[ModelUnit]:
    """Split a megatron-core GPTModel chunk (one pipeline stage) into units: the
    embedding, one per transformer layer, and the final norm with the output layer.

    A word embedding tied to the output layer is a unit of its own, on whichever
    stage holds a copy, so that its segments line up between the first and last
    pipeline stage (their gradients are summed there). On a single stage the
    output layer becomes an extra site of that unit."""
    named = dict(model.named_parameters())  # de-duplicates shared parameters: first name wins
    by_id = {id(p): n for n, p in named.items()}
    pre, post = getattr(model, "pre_process", True), getattr(model, "post_process", True)
    embedding = getattr(model, "embedding", None)
    output_layer = getattr(model, "output_layer", None)
    tied_param, tied_unit = None, None
    if getattr(model, "share_embeddings_and_output_weights", False) and (pre or post):
        tied_param = model.shared_embedding_or_output_weight()
        if pre:
            sites = [output_layer] if post and output_layer is not None else []
            tied_unit = ModelUnit("tied_embedding", [(by_id[id(tied_param)], tied_param)], [embedding], sites)
        else:
            tied_unit = ModelUnit("tied_embedding", [(by_id[id(tied_param)], tied_param)], [output_layer])

    groups: List[Tuple[str, List[torch.nn.Module]]] = []
    if embedding is not None:
        groups.append(("embedding", [embedding]))
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise ValueError(f"{type(model).__name__} has no .decoder: not a megatron-core GPTModel chunk")
    for i, layer in enumerate(decoder.layers):
        groups.append((f"layer{getattr(layer, 'layer_number', i + 1)}", [layer]))
    final_modules = [m for m in (getattr(decoder, "final_layernorm", None), output_layer) if m is not None]
    if final_modules:
        groups.append(("final", final_modules))

    seen = {id(tied_param)} if tied_param is not None else set()
    units = []
    for name, modules in groups:
        params = []
        for module in modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append((by_id[id(p)], p))
        units.append(ModelUnit(name, params, modules))
    missing = [n for n, p in named.items() if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters outside every unit: {missing}")
    units = [u for u in units if u.params]
    if tied_unit is not None:
        units.insert(0 if pre else len(units), tied_unit)
    return units


def qkv_block_rows(config, tp_size: int = 1) -> Tuple[int, int, int]:
    """Rows per query group of Q, K and V in megatron-core's linear_qkv weight."""
    heads_per_group = config.num_attention_heads // config.num_query_groups
    return (heads_per_group * config.kv_channels, config.kv_channels, config.kv_channels)


def unit_specs(units: Sequence[ModelUnit], user_rules=(), qkv_rows: Optional[Tuple[int, int, int]] = None) -> List[UnitSpec]:
    """Classify and cost the parameters of model units for the planner."""
    specs = []
    for unit in units:
        params = []
        for name, p in unit.params:
            kind = classify_parameter(name, p.shape, user_rules)
            cost = 0
            if kind == MUON:
                blocks = None
                if qkv_rows is not None and name.endswith("linear_qkv.weight"):
                    groups = p.shape[0] // sum(qkv_rows)
                    blocks = [groups * r for r in qkv_rows]
                cost = newton_schulz_cost(p.shape, blocks)
            params.append(ParamSpec(name, tuple(p.shape), kind, cost))
        specs.append(UnitSpec(unit.name, params))
    return specs
