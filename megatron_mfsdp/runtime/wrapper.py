"""The owner-sharded ZeRO-3 runtime: a model wrapper that keeps only this rank's
segment of every unit and materializes units around their use.

Life of a unit in one training step (see docs/design.md)::

    forward:  acquire (gather from owners, prefetch next) -> compute -> release
    backward: acquire again (hook on the unit's output) -> compute -> grads ready
              -> reduce: each owner receives its segment summed over DP -> release

Released parameters point at an empty tensor. A gathered buffer is never resized or
reused in place: releasing only drops our reference, so a view that autograd (or user
code) still holds keeps its own storage alive and stays correct, and the memory
returns when that view dies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections import deque
from collections.abc import Iterator

import torch
from torch.utils._pytree import tree_flatten

from ..checkpoint import boxes
from ..config import MatrixFSDPConfig
from ..groups import ProcessGroups, gather_objects
from ..models import ModelAdapter, ModelUnit, adapter_for
from ..placement.layout import UnitLayout, UnitSpec
from ..placement.planner import RankLoads
from ..placement.specs import unit_specs
from ..precision import UnitCodec, fp8_slot_names, new_fp8_state, te_available, te_float8_weight
from ..profiling import GATHER, REDUCE, WAIT, profile_range
from .comm import all_reduce_flat, param_runs_view
from .domain import DENSE, EXPERT, ShardDomain, build_domain
from .main_grad import MainGrads
from .traffic import UnitWire, iteration_links


class _UnitState:
    """Runtime state of one unit on this rank, in its shard domain (whose comm moves it)."""

    def __init__(
        self, unit: ModelUnit, layout: UnitLayout, domain: ShardDomain, dtype: torch.dtype, grad_dtype, device
    ):
        self.unit = unit
        self.layout = layout
        self.domain = domain
        self.index = layout.index  # in model order over every domain: MatrixFSDP sets it
        rank = domain.dp_rank
        self.tensors = list(unit.params)  # (name, parameter), each once, in model order
        self.by_name = dict(unit.params)
        self.shapes = {name: tuple(p.shape) for name, p in unit.params}
        # (slot, its parameter): a parameter placed as Q, K and V blocks appears once per block
        self.params = [(slot, self.by_name[slot.param_name]) for slot in layout.slots]
        self.blocks = _block_slots(layout, self.shapes)
        self.pieces = layout.local_pieces(rank)
        self.param_segment = torch.empty(layout.segment_numel(rank), dtype=dtype, device=device)
        self.grad_segment = torch.zeros(layout.segment_numel(rank), dtype=torch.float32, device=device)
        self.grad_dtype = grad_dtype
        self.full: torch.Tensor | None = None
        self.pending = None  # a PendingGather of a prefetch in flight
        self.forward_refs = 0
        self.held_to_sites = False  # a tied unit, held in forward from its first module to its last extra site
        self.held_for_backward = False
        self.grads_seen: set[int] = set()  # ids of the parameters whose gradient arrived since the last reduction
        self.grad_params = sum(1 for _, p in self.tensors if p.requires_grad)
        self.codec: UnitCodec | None = None  # FP8 matrices: the segment holds bytes (precision/segments.py)
        self.main_grads: MainGrads | None = None  # --gradient-accumulation-fusion: what the layers write
        self.initial_values: torch.Tensor | None = None  # FP8: the initial weights, until masters are seeded

    @property
    def wire(self) -> UnitLayout:
        """The layout the gather moves: elements, or bytes when the unit holds FP8 matrices."""
        return self.layout if self.codec is None else self.codec.wire


def _block_slots(layout: UnitLayout, shapes: dict) -> dict[str, list]:
    """Parameter name -> its slots in row order, for each parameter placed as row blocks (Q, K and V
    apart, placement/blocks.py). Their runs must tile it: within each period (a query group's rows)
    the blocks' runs follow each other, and the periods cover the parameter."""
    blocks: dict[str, list] = {}
    for slot in layout.slots:
        if slot.param is not None:
            blocks.setdefault(slot.param, []).append(slot)
    for name, slots in blocks.items():
        slots.sort(key=lambda s: s.param_start)
        runs = [s.runs() for s in slots]  # (first, run, stride, count)
        period, count = runs[0][2], runs[0][3]
        ends = [first + run for first, run, _, _ in runs]
        if (
            runs[0][0] != 0
            or [r[0] for r in runs[1:]] != ends[:-1]
            or ends[-1] != period
            or any(r[2:] != (period, count) for r in runs)
            or period * count != math.prod(shapes[name])
        ):
            raise ValueError(f"{name}: its Q, K and V blocks {[s.name for s in slots]} do not tile it: {runs}")
    return blocks


def is_expert(param: torch.nn.Parameter) -> bool:
    """megatron-core marks an expert's parameters ``allreduce = False`` (tensor_parallel/layers.py, the
    TE extensions): their gradients are reduced over expert data parallelism, not DP."""
    return not getattr(param, "allreduce", True)


def split_expert_units(units: list[ModelUnit], groups: ProcessGroups) -> list[tuple[ModelUnit, str]]:
    """Each unit as (its dense part, DENSE) and (its experts, EXPERT), in model order, the two sharing
    the unit's modules (acquired and released together). Experts get a domain of their own only where
    expert parallelism makes their group differ from DP (EP above 1); at EP 1 they are dense matrices."""
    if groups.ep_size == 1:
        return [(u, DENSE) for u in units]
    out = []
    for unit in units:
        for name, params in ((DENSE, [p for p in unit.params if not is_expert(p[1])]),
                             (EXPERT, [p for p in unit.params if is_expert(p[1])])):  # fmt: skip
            if params:
                suffix = ".experts" if name == EXPERT else ""
                out.append((dataclasses.replace(unit, name=unit.name + suffix, params=params), name))
    return out


class MatrixFSDP(torch.nn.Module):
    """Owner-sharded ZeRO-3 wrapper of a megatron-core model chunk.

    Mirrors megatron-core's ``DistributedDataParallel``: holds ``module``, ``config``
    (the TransformerConfig) and ``ddp_config`` (a MatrixFSDPConfig), and offers
    ``zero_grad_buffer``, ``no_sync``, ``finish_grad_sync``. ``groups`` defaults to
    megatron's parallel_state groups; ``adapter`` to the model's own (models/).
    """

    def __init__(
        self,
        config,
        ddp_config: MatrixFSDPConfig,
        module: torch.nn.Module,
        groups: ProcessGroups | None = None,
        adapter: ModelAdapter | None = None,
    ):
        super().__init__()
        self.config, self.ddp_config, self.module = config, ddp_config, module
        self.groups = groups if groups is not None else ProcessGroups.from_parallel_state()
        adapter = adapter if adapter is not None else adapter_for(module)
        units = adapter.units(module)
        self.global_names: dict[str, str] = adapter.global_names(module)
        dtypes = {p.dtype for u in units for _, p in u.params}
        if len(dtypes) != 1:
            raise ValueError(f"MatrixFSDP needs one parameter dtype per model chunk, found {dtypes}")
        self.param_dtype = dtypes.pop()
        self.device = next(p.device for u in units for _, p in u.params)
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else self.param_dtype
        self.grad_dtype = grad_dtype  # the wire dtype of the reduction (the owner accumulates in fp32)
        parts = split_expert_units(units, self.groups)  # (unit, its domain's name), in model order
        self.domains: dict[str, ShardDomain] = {}
        for name in (DENSE, EXPERT):
            mine = [u for u, domain in parts if domain == name]
            if mine or name == DENSE:
                self.domains[name] = self._domain(name, unit_specs(mine, ddp_config, adapter, config))
        self._shard_metadata: dict[str, list] | None = None  # megatron's checkpoint metadata, on first use
        self._in_flight: deque = deque()  # (unit state, PendingReduce) of reductions not yet waited for
        self._empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        layouts = {name: iter(domain.plan.units) for name, domain in self.domains.items()}
        self.units = [  # every domain's units, in model order
            _UnitState(u, next(layouts[name]), self.domains[name], self.param_dtype, grad_dtype, self.device)
            for u, name in parts
        ]
        for index, state in enumerate(self.units):
            state.index = index  # the place in model order that prefetch walks (a layout's index counts in its plan)
            state.domain.units.append(state)
        self._materialize_fp8 = None  # TE's FP8 tensor on a GPU with TE; None dequantizes
        self._shard_initial_weights()
        if getattr(config, "gradient_accumulation_fusion", False):  # the layers read weight.main_grad
            for state in self.units:
                if state.grad_params:
                    state.main_grads = MainGrads(state.tensors, state.shapes, self.device)
        if ddp_config.fp8 is not None:
            self._use_fp8(ddp_config, getattr(config, "num_layers", 0))
        self._install_hooks()

    # ------------------------------------------------------------------ setup
    def _domain(self, name: str, specs: list[UnitSpec]) -> ShardDomain:
        """Dense parameters over the DP shard group (its replicas with --mfsdp-replicate-size), experts
        over megatron-core's expert-data-parallel group (split into replicas alike: groups.py), both
        averaged over DP like megatron-core's DDP: without ``average_in_collective`` it scales dense
        and expert gradients alike by 1 / DP (distributed/distributed_data_parallel.py at
        core_v0.16.1), an expert's gradient already
        holding its EP peers' tokens. With a per-token loss the schedule's finalize step divides by the
        global token count instead (megatron's calculate_per_token_loss)."""
        expert = name == EXPERT
        per_token = getattr(self.config, "calculate_per_token_loss", False)
        shard = self.groups.expt_dp if self.groups.expt_dp_shard is None else self.groups.expt_dp_shard
        domain = build_domain(
            name,
            shard if expert else self.groups.dp_shard,
            self.groups.expt_replica if expert else self.groups.replica,
            specs,
            self.ddp_config,
            averaged_over=None if per_token else self.groups.dp_shard_size * self.groups.replica_size,
            tp=self.groups.expt_tp if expert else self.groups.tp,
            base=self._dense_loads(shard) if expert else None,
            param_bytes=torch.empty(0, dtype=self.param_dtype).element_size(),
            verify=self.ddp_config.verify_collectives,
            device=self.device,
            reduce_order=self.ddp_config.reduce_order,
            levels=None if expert else self.groups.dense_levels,
        )
        domain.plan.element_size = torch.empty(0, dtype=self.param_dtype).element_size()
        return domain

    def _dense_loads(self, shard) -> RankLoads:
        """What each rank of the expert shard group ``shard`` owns in the dense domain (its plan's cost and
        weight at that rank's dense DP rank), so the experts' owners balance each rank's total. Taken
        elementwise at its largest over the expert TP group, whose ranks must plan alike. Collective."""
        dense, rank = self.domains[DENSE].plan, self.domains[DENSE].dp_rank
        members = gather_objects((dense.cost_per_rank[rank], dense.per_rank_weight()[rank]), shard)
        peers = gather_objects(members, self.groups.expt_tp)
        members = [tuple(max(values) for values in zip(*column)) for column in zip(*peers)]
        return RankLoads(tuple(c for c, _ in members), tuple(w for _, w in members))

    @property
    def dense(self) -> ShardDomain:
        """The dense parameters' domain (every unit's, until experts have one of their own)."""
        return self.domains[DENSE]

    # The dense domain's plan, comm, ranks and scaling, under the names megatron-core's DDP, the
    # optimizer, checkpoints and tools read.
    plan = property(lambda self: self.dense.plan)
    comm = property(lambda self: self.dense.comm)
    dp_rank = property(lambda self: self.dense.dp_rank)
    dp_size = property(lambda self: self.dense.dp_size)
    gradient_scaling_factor = property(lambda self: self.dense.gradient_scaling_factor)

    @torch.no_grad()
    def _shard_initial_weights(self) -> None:
        """Keep this rank's segment of the (identically initialized) full weights,
        then drop the full weights: from here on, owners are the source of truth."""
        for state in self.units:
            for piece in state.pieces:
                src = param_runs_view(state.by_name[piece.slot.param_name].detach().reshape(-1), piece.runs())
                dst = state.param_segment[piece.segment_offset : piece.segment_offset + piece.numel]
                dst.view(src.shape).copy_(src)
            for _, p in state.tensors:
                p.data = self._empty
                p.grad = None

    @torch.no_grad()
    def _use_fp8(self, ddp_config: MatrixFSDPConfig, num_layers: int) -> None:
        """Units with FP8 matrices keep a byte segment, encoded here from the initial weights (the
        optimizer seeds its fp32 masters from ``initial_values``, never from FP8, and re-encodes)."""
        for state in self.units:
            names = fp8_slot_names(state.layout, self.global_names, num_layers, ddp_config.fp8_bf16_layers)
            if not names:
                continue
            state.codec = UnitCodec(state.layout, state.domain.dp_rank, names, ddp_config.fp8, self.param_dtype)
            state.initial_values = state.param_segment
            state.param_segment = torch.empty(state.codec.segment_nbytes(), dtype=torch.uint8, device=self.device)
            fresh = {name: new_fp8_state(ddp_config.fp8, self.device) for name in names}
            state.codec.encode(state.param_segment, state.initial_values.float(), fresh, advance=True)
        use_te = te_available() and self.device.type == "cuda"
        self._materialize_fp8 = te_float8_weight if use_te else None

    def _install_hooks(self) -> None:
        """Acquire before the first module of a unit, release after the last;
        extra sites (a tied output layer) acquire and release around themselves."""
        acquire_at: dict[torch.nn.Module, list[_UnitState]] = {}
        release_at: dict[torch.nn.Module, list[_UnitState]] = {}
        for state in self.units:
            acquire_at.setdefault(state.unit.modules[0], []).append(state)
            release_at.setdefault(state.unit.modules[-1], []).append(state)
            for site in state.unit.extra_sites:
                acquire_at.setdefault(site, []).append(state)
                release_at.setdefault(site, []).append(state)
        for module, states in acquire_at.items():
            module.register_forward_pre_hook(self._make_pre_forward(module, states))
        for module, states in release_at.items():
            module.register_forward_hook(self._make_post_forward(module, states))
        for state in self.units:
            for _, p in state.tensors:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._make_grad_ready(state))

    def _make_pre_forward(self, module, states):
        def hook(module, args):
            for state in states:
                self._acquire(state, "forward")
                state.forward_refs += 1
                if module is state.unit.modules[0]:  # not at extra sites (a tied output layer)
                    state.held_to_sites = bool(state.unit.extra_sites)
                    self._prefetch(state.index, +1)

        return hook

    def _make_post_forward(self, module, states):
        def hook(module, args, output):
            for state in states:
                state.forward_refs -= 1
                if state.unit.extra_sites and module is state.unit.extra_sites[-1]:
                    state.held_to_sites = False  # the tied weight's last use in this forward
                if state.forward_refs == 0 and not (state.held_for_backward or state.held_to_sites):
                    self._release(state)
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._make_pre_backward(states))
            return None

        return hook

    def _make_pre_backward(self, states):
        def hook(grad):
            for state in states:
                if state.grad_params and not state.held_for_backward:
                    self._acquire(state, "backward")
                    state.held_for_backward = True
                    if state.main_grads is not None:
                        state.main_grads.materialize()
                    self._prefetch(state.index, -1)
            return None

        return hook

    def _make_grad_ready(self, state: _UnitState):
        """The hook lives on the parameter, in C++, where Python's collector cannot see it: it
        holds the wrapper and the unit weakly, or parameter -> hook -> unit -> parameter would
        be a cycle no one frees (the whole model, and its process groups' threads)."""
        wrapper, unit = weakref.ref(self), weakref.ref(state)

        def hook(param):
            self, state = wrapper(), unit()
            if self is None or state is None:
                return
            state.grads_seen.add(id(param))  # a set: a unit held over micro-batches counts each parameter once
            if state.main_grads is not None:
                state.main_grads.absorb(param)
            if len(state.grads_seen) == state.grad_params:
                self._reduce_and_release(state)

        return hook

    # ------------------------------------------------------- materialization
    def _prefetch(self, index: int, step: int) -> None:
        """Start gathering the next ``prefetch_depth`` units in this direction (forward +1, backward -1)."""
        depth = self.ddp_config.prefetch_depth if self.ddp_config.prefetch else 0
        phase = "forward" if step > 0 else "backward"
        for ahead in range(index + step, index + step * (depth + 1), step):
            if not 0 <= ahead < len(self.units):
                return
            state = self.units[ahead]
            if state.full is None and state.pending is None:
                state.pending = self._start_gather(state, phase)

    def _start_gather(self, state: _UnitState, phase: str):
        """In forward and backward this rank's own matrices are viewed in its segment, not copied into
        the gathered buffer (elsewhere, e.g. ``materialized``, the buffer holds everything: what a
        caller writes into the weights there never reaches the segment)."""
        own_views = state.codec is None and phase in ("forward", "backward")
        with profile_range(GATHER.format(state.layout.name)):
            return state.domain.comm.start_gather(state.wire, state.param_segment, phase, own_views)

    def _acquire(self, state: _UnitState, phase: str = "other") -> None:
        if state.full is not None:
            return
        pending = state.pending if state.pending is not None else self._start_gather(state, phase)
        state.pending = None
        with profile_range(WAIT.format(state.layout.name)):
            full = pending.wait()
        state.full = full
        if state.codec is not None:  # every rank dequantizes the owners' bytes identically
            values = state.codec.decode(full, self._materialize_fp8)
            for slot, p in state.params:
                p.data = values[slot.name]
            return

        def elements(offset: int, numel: int) -> torch.Tensor:  # from the segment where this rank owns them
            own = pending.own
            if own is not None and own[0] <= offset and offset + numel <= own[1]:
                return state.param_segment[offset - own[0] : offset - own[0] + numel]
            return full[offset : offset + numel]

        for slot, p in state.params:
            if slot.param is None:
                p.data = elements(slot.offset, slot.numel).view(slot.shape)
        for name, slots in state.blocks.items():  # Q, K, V from their owners' parts: one copy
            merged = torch.empty(math.prod(state.shapes[name]), dtype=full.dtype, device=full.device)
            for s in slots:
                view = param_runs_view(merged, s.runs())
                view.copy_(elements(s.offset, s.numel).view(view.shape))
            state.by_name[name].data = merged.view(state.shapes[name])

    def _release(self, state: _UnitState) -> None:
        for _, p in state.tensors:
            p.data = self._empty
        state.full = None

    @torch.no_grad()
    def _reduce_and_release(self, state: _UnitState) -> None:
        layout = state.layout
        if state.main_grads is not None:  # the fused layers' fp32 sums, with every p.grad added in
            grads = state.main_grads.views
        else:
            grads = {name: p.grad for name, p in state.tensors if p.grad is not None}
        if self.groups.tp_size > 1 and getattr(self.config, "sequence_parallel", False):
            # Norms and biases see only this TP rank's part of the sequence: sum their
            # gradients over TP (megatron's finalize_model_grads does the same).
            sp = [grads[n] for n, p in state.tensors if n in grads and getattr(p, "sequence_parallel", False)]
            all_reduce_flat(sp, self.groups.tp)
        domain = state.domain
        with profile_range(REDUCE.format(layout.name)):
            direct = state.main_grads is None  # MainGrads' buffer is freed below: pack from it first
            scale = domain.gradient_scaling_factor
            pending = domain.comm.start_reduce_grads(layout, grads, state.grad_dtype, scale, direct)
        for _, p in state.tensors:
            p.grad = None
        if state.main_grads is not None:
            state.main_grads.free()
        overlap = self.ddp_config.overlap_grad_reduce
        state.grads_seen = set()
        state.held_for_backward = False
        self._release(state)
        self._in_flight.append((state, pending))
        # FIFO: a unit's reductions land in its fp32 accumulator in micro-batch order, as without overlap.
        while len(self._in_flight) > (self.ddp_config.max_reduces_in_flight if overlap else 0):
            self._complete_oldest_reduce()

    @torch.no_grad()
    def _complete_oldest_reduce(self) -> None:
        state, pending = self._in_flight.popleft()
        with profile_range(WAIT.format(state.layout.name)):
            pending.add_to(state.grad_segment)

    def wait_for_reductions(self) -> None:
        """Land every reduction in flight in its owner's accumulator (before gradient segments are read)."""
        while self._in_flight:
            self._complete_oldest_reduce()

    # ------------------------------------------------ megatron DDP interface
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        """Zero this rank's gradient segments (megatron-core DDP's name)."""
        self.wait_for_reductions()
        for state in self.units:
            state.grad_segment.zero_()

    @contextlib.contextmanager
    def no_sync(self):
        """Accepted for megatron's schedules. ZeRO-3 keeps no full gradients, so gradients
        are still reduced after every micro-batch (into the owners' fp32 accumulators):
        the same sum as deferring the sync, added per micro-batch."""
        yield

    def start_grad_sync(self, *unused) -> None:
        pass

    def finish_grad_sync(self) -> None:
        """Reduce any unit whose gradients were not all produced (parameters unused in this
        step). Every rank sees the same graph, so they agree on which."""
        for state in self.units:
            if state.grads_seen or state.held_for_backward:
                self._reduce_and_release(state)
            # A prefetch the backward never used is landed here: the gather sends from the live
            # segment, which the optimizer step rewrites.
            if state.pending is not None:
                state.pending.wait()
                state.pending = None
        self.wait_for_reductions()

    def scale_gradients(self, scaling_factor: float) -> None:
        self.wait_for_reductions()
        for state in self.units:
            state.grad_segment.mul_(scaling_factor)

    # ------------------------------------------------------------ utilities
    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """Gather every unit for the duration of the block (state dicts, evaluation outside
        hooks, checkpoint conversion). Collective: call on all DP ranks."""
        for state in self.units:
            self._acquire(state)
            state.forward_refs += 1
        try:
            yield
        finally:
            for state in self.units:
                state.forward_refs -= 1
                if state.forward_refs == 0:
                    self._release(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) model weights, cloned, on every rank."""
        with self.materialized():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items() if isinstance(v, torch.Tensor)}

    def gathered(self, which: str = "param") -> list[torch.Tensor]:
        """Every unit's full flat buffer of parameters ('param') or reduced gradients ('grad'),
        gathered from the owners' segments. Collective."""
        self.wait_for_reductions()
        out = []
        for state in self.units:
            comm = state.domain.comm
            if which == "param":
                full = comm.start_gather(state.wire, state.param_segment).wait()
                out.append(full if state.codec is None else state.codec.decode_flat(full))
            else:
                out.append(comm.start_gather(state.layout, state.grad_segment).wait())
        return out

    def traffic_per_iteration(self, num_micro: int) -> dict[str, tuple[int, int]]:
        """Bytes per iteration over the shard group, per phase: (the critical path: for each unit
        operation the busiest rank's larger direction, summed; ZeRO-3's bytes per rank for the same
        operations). Each unit is gathered once in forward (a tied embedding is held to the output
        layer) and once in backward, and reduced once, per micro-batch (runtime/traffic.py);
        ``comm.traffic`` and ``comm.log`` count what actually moved (the tests compare them). Each
        domain's calls run over its own shard group, one after another: their bytes add."""
        totals: dict[str, tuple[int, int]] = {}
        for domain in self.domains.values():
            units = [
                UnitWire(
                    s.layout,
                    s.wire,
                    s.param_segment.element_size(),
                    domain.plan.element_size,
                    sum(slot.numel for slot, p in s.params if p.requires_grad),
                    (domain.comm.algorithm(s.layout.index, False), domain.comm.algorithm(s.layout.index, True)),
                    domain.comm.levels.per_node,
                )
                for s in domain.units
            ]
            links = iteration_links(units, num_micro, domain.comm.reduce_order, self.grad_dtype.itemsize)
            for phase, (ours, zero3) in links.items():
                before = totals.get(phase, (0, 0))
                totals[phase] = (before[0] + ours, before[1] + zero3)
        return totals

    def traffic_line(self, num_micro: int) -> str:
        """The start-up line: per phase, the busiest rank of each call summed over an iteration, and
        its ratio to ZeRO-3's bytes per rank (W / (W - 1) when every rank moves one unit per call)."""
        parts = []
        for phase, (ours, zero3) in self.traffic_per_iteration(num_micro).items():
            ratio = ours / zero3 if zero3 else 1.0
            parts.append(f"{phase} {ours / 2**20:.2f} MiB (ZeRO-3 x{ratio:.2f})")
        return (
            f"traffic per iteration, busiest rank of each call ({num_micro} micro-batches, DP shard "
            f"{self.dp_size}, reduce order {self.comm.reduce_order}): " + ", ".join(parts)
        )

    def local_bytes(self) -> dict[str, int]:
        """Bytes this rank holds persistently for the model (not the optimizer)."""
        return {
            "params": sum(s.param_segment.numel() * s.param_segment.element_size() for s in self.units),
            "grads": sum(s.grad_segment.numel() * s.grad_segment.element_size() for s in self.units),
        }

    def plan_digest(self) -> str:
        """What a same-layout checkpoint must match: the dense plan's digest, then any other domain's as
        ``name:digest`` (one domain: its plan's digest, as checkpoints stored before domains)."""
        rest = [f"{name}:{domain.plan.digest()}" for name, domain in self.domains.items() if name != DENSE]
        return "|".join([self.dense.plan.digest(), *rest])

    # ------------------------------------------------------ checkpoint shards
    def shard_metadata(self, metadata=None) -> dict[str, list]:
        """Local parameter name -> [(megatron ShardedTensor, flat start in the TP-local tensor)], from
        megatron-core's own ``sharded_state_dict`` of the module (checkpoint/boxes.py), once."""
        if self._shard_metadata is None:
            shapes = {name: shape for state in self.units for name, shape in state.shapes.items()}
            self._shard_metadata = boxes.megatron_shards(self.module, shapes, metadata)
        return self._shard_metadata

    def piece_shards(self, tensors: dict[str, torch.Tensor], key_prefix: str = "", metadata=None) -> dict[str, list]:
        """ShardedTensors of this rank's pieces: ``tensors`` maps a slot name (a local parameter name,
        or ``NAME[q]`` for a Q, K or V block placed apart) to the flat data of its piece (weights, a
        master, a moment), cut into boxes of megatron's tensors (checkpoint/boxes.py: piece_shards)
        under ``key_prefix + megatron key``."""
        by_name = {piece.slot.name: (piece, state.domain) for state in self.units for piece in state.pieces}
        shards = self.shard_metadata(metadata)
        out = {}
        for name, data in tensors.items():
            piece, domain = by_name[name]
            replica = domain.replica_rank  # the replica id's DP coordinate: one replica saves
            out[name] = boxes.piece_shards(piece, data, shards[piece.slot.param_name], key_prefix, replica)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict[str, list]:
        """The weights this rank holds, as megatron-core dist_checkpointing ShardedTensors under
        megatron-core's GPTModel keys (see :meth:`piece_shards`). Units with FP8 matrices hold bytes:
        their weights travel as the optimizer's fp32 masters only."""
        segments = {}
        for state in self.units:
            if state.codec is not None:
                continue
            for piece in state.pieces:
                segments[piece.slot.name] = state.param_segment[
                    piece.segment_offset : piece.segment_offset + piece.numel
                ]
        out = {prefix + name: shards for name, shards in self.piece_shards(segments, metadata=metadata).items()}
        for i, (sh, _) in enumerate(self.shard_metadata(metadata)[boxes.BUFFERS]):  # a router's expert bias, whole
            out[f"{prefix}{boxes.BUFFERS}{i}"] = sh  # megatron's key, stacked over layers, is in the tensor
        return out
