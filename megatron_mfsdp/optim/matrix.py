"""What every whole-matrix rule shares, so that a rule (Muon, adaptive Muon, SOAP, Shampoo, a toy)
is its math alone.

A matrix rule is written as :class:`MatrixMath`: the state of one matrix of a given shape and the
update direction from its gradient and state, plus optional hooks. :func:`matrix_rule` turns it into
the owner rule and its ``--mfsdp-layout even`` variant; everything else is here, once:

- On its owner the step runs the math on the whole matrix and applies the direction with decoupled
  weight decay: no collective on tensor data. Same-shape matrices of one owner go through the
  ``batched`` hook in one call where batching pays (:data:`BATCHED_ON`), else one matrix at a time.
- Tensor parallelism, by the rule's TP mode (:data:`TP_MODES`): ``blockwise`` runs the math on the
  TP-local shard (no communication; the numbers depend on the TP size); ``duplicated`` all-gathers the
  matrix over TP, runs the math on the whole matrix (its whole-matrix state the same on every TP rank)
  and keeps the local slice: the numbers of TP = 1; ``distributed`` leaves the shards in place and runs
  the ``sharded`` hook, which talks to the TP group itself (Muon's Gram all-reduce). A rule without
  that hook refuses ``distributed``.
- The even variant (the reconstruction baseline) gathers each matrix over the DP shard group, runs
  the same math on every rank that holds a slice (each keeping the whole matrix's state, replicated)
  and keeps its slice: the owner's numbers, with the gathers and the replicated state the owner
  layout avoids.

What is elementwise in the parameter stays on whatever part of it a rank holds: the ``prepare`` hook
(Muon's momentum) runs before the gather, ``finish`` (AdaMuon's second moment) after the slice is
taken, and their state (``elementwise``) is shaped like that part and split like the parameter in
checkpoints. Any other state is of the whole matrix and checkpointed whole under its matrix's name
(optimizer.py ``_matrix_states``), so any DP, PP or (in an exact TP mode) TP layout reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..compat.collectives import all_gather_single
from ..groups import group_rank, group_size
from ..placement.classes import SLICE, WHOLE
from .rule import GroupMatrix, OwnedPiece, StepContext, UpdateRule, never

TP_MODES = ("blockwise", "duplicated", "distributed")
"""How a matrix rule steps a tensor-parallel shard (megatron-core's ``muon_tp_mode`` names): every
rule has the first two; ``distributed`` needs the rule's ``sharded`` hook."""

BATCHED_ON = {"cuda": True, "cpu": False}
"""Where an owner's same-shape matrices run through the ``batched`` hook (one call per stack). On CUDA
a stack is one launch per product instead of one per matrix. On a CPU the loop: BLAS runs a stacked
product as the same kernel per entry, which measured no faster on this project's CPUs
(benchmarks/bench_optimizer_step.py --batched, benchmarks/results/batched_directions.md), and the loop
keeps the owner's sums in the single-process reference's order."""

FORCE_BATCHED: bool | None = None
"""For the tests and benchmarks/bench_optimizer_step.py --batched: True runs every rule's batched hook,
False none, None (training) each rule's ``batched_on`` or :data:`BATCHED_ON`."""

BATCH_ELEMENTS = 1 << 26
"""Most elements stacked into one batched call (256 MiB in fp32): bounds the copy."""


@dataclass(frozen=True)
class TpShard:
    """Where this rank's shard of a TP-split matrix sits (what a ``sharded`` hook needs)."""

    dim: int  # the split dimension (0: rows, column-parallel; 1: columns, row-parallel)
    group: object  # the TP group
    size: int
    rank: int

    def full(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The whole matrix's shape of a shard (or block of a shard) of ``shape``."""
        return tuple(int(s) * (self.size if i == self.dim else 1) for i, s in enumerate(shape))


def no_state(shape, settings) -> dict[str, Tensor]:
    """A rule that keeps nothing of the whole matrix (Muon: its momentum is elementwise)."""
    return {}


@dataclass(frozen=True)
class MatrixMath:
    """One whole-matrix optimizer, as math on a single matrix."""

    direction: Callable[..., Tensor]
    """(fp32 input, state, hyper, 1-based step) -> the update direction, shaped like the input; updates the
    state in place. The input is the gradient, or what ``prepare`` made of it. The step applies
    ``param -= lr * (scale * direction + weight_decay * param)``."""
    init: Callable[[tuple[int, int], object], dict[str, Tensor]] = no_state
    """The whole-matrix state of one matrix of this (rows, cols) shape under these settings: any shapes."""
    hyper: Callable[[object, object], object] | None = None
    """(the rule's settings, the optimizer config) -> what the hooks get as ``hyper``, for a rule that also
    reads shared flags (--adam-beta1/2, --adam-eps, megatron-core's muon_* fields); None: the settings."""
    elementwise: tuple[str, ...] | Callable[[object], tuple[str, ...]] = ()
    """State shaped like the parameter, updated elementwise by ``prepare`` or ``finish`` (zeros at the
    start): held for the part of the parameter a rank holds, split like the parameter in checkpoints.
    A tuple of names, or a function of the settings."""
    prepare: Callable[[Tensor, dict[str, Tensor], object], Tensor] | None = None
    """Elementwise, before the whole matrix is needed: (fp32 gradient, state, hyper) -> ``direction``'s
    input. Runs on the part a rank holds, before any gather (Muon's momentum)."""
    finish: Callable[[Tensor, dict[str, Tensor], object], Tensor] | None = None
    """Elementwise, after: (this rank's part of the direction, state, hyper) -> the direction applied."""
    scale: Callable[..., float] | None = None
    """((rows, cols) of the whole matrix, hyper[, split rows]) -> a factor folded into the learning rate
    (Muon's shape scale, as torch.optim.Muon folds it); None: 1."""
    batched: Callable[..., Tensor] | None = None
    """(a (B, rows, cols) stack of inputs, the B states, hyper, step) -> the B directions stacked: the numbers
    of ``direction`` on each, within the rounding of stacked products (tested per rule)."""
    sharded: Callable[..., Tensor] | None = None
    """(this rank's shard of the input, the whole matrix's state, hyper, step, :class:`TpShard`) -> this
    rank's shard of the whole matrix's direction, talking to the TP group (``--*-tp-mode distributed``)."""
    batched_on: tuple[str, ...] | None = None
    """Device types where the owner runs ``batched`` (where it pays); None: :data:`BATCHED_ON`'s."""
    qkv: bool = False
    """Whether the math updates Q, K and V apart: then ``direction``, ``batched``, ``sharded`` and ``scale``
    take the rows per query group (None: the whole matrix) as their last argument, and the rule says when
    the split is on (``matrix_rule(splits_qkv=...)``)."""

    def tp_modes(self) -> tuple[str, ...]:
        return TP_MODES if self.sharded is not None else TP_MODES[:2]


def gather_over_tp(x: Tensor, dim: int, group) -> Tensor:
    """The whole matrix of which each rank of the TP ``group`` holds the shard ``x`` along ``dim``."""
    world = dist.get_world_size(group)
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    all_gather_single(out, x.contiguous().view(-1), group=group)
    return torch.cat(list(out.view((world,) + tuple(x.shape)).unbind(0)), dim=dim)


def gather_slices(local: Tensor, bounds: Sequence[int], group) -> Tensor:
    """The flat parameter whose slice [bounds[r], bounds[r + 1]) rank r holds, on every rank of
    ``group``: one all_to_all_single that sends this rank's slice to each rank (exact bytes)."""
    world = len(bounds) - 1
    if world == 1:
        return local.reshape(-1)
    counts = [bounds[r + 1] - bounds[r] for r in range(world)]
    out = torch.empty(bounds[-1], dtype=local.dtype, device=local.device)
    send = local.reshape(-1).repeat(world)
    dist.all_to_all_single(out, send, counts, [local.numel()] * world, group=group)
    return out


def group_device(group) -> torch.device:
    """Where a rank that holds no slice makes its empty send buffer: NCCL needs a CUDA tensor."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_decoupled_(master: Tensor, direction: Tensor, lr: float, weight_decay: float, scale: float = 1.0) -> None:
    """Decoupled weight decay with the unscaled lr, then the step along ``direction`` times ``scale``
    (AdamW's and torch.optim.Muon's order and rounding: one ``add_`` with alpha ``-lr * scale``)."""
    master.mul_(1 - lr * weight_decay)
    master.add_(direction if direction.shape == master.shape else direction.view_as(master), alpha=-lr * scale)


def _split(math: MatrixMath, rows) -> tuple:
    return (rows,) if math.qkv else ()


def finish_step_(
    math: MatrixMath, master: Tensor, direction: Tensor, state, hyper, shape, rows, lr, weight_decay
) -> None:
    """``finish``, then the step along the direction with the whole (``shape``) matrix's ``scale``."""
    if math.finish is not None:
        direction = math.finish(direction, state, hyper)
    scale = 1.0 if math.scale is None else math.scale(tuple(shape), hyper, *_split(math, rows))
    apply_decoupled_(master, direction, lr, weight_decay, scale)


def step_matrix_(
    math: MatrixMath,
    master: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    hyper,
    step: int,
    *,
    lr: float,
    weight_decay: float,
    split_rows=None,
) -> None:
    """One step of one whole matrix (or TP-local shard): ``prepare``, ``direction``, ``finish``, the update.
    What the owner runs per matrix, and the single-process reference (muon.muon_step_, the tests)."""
    x = grad if math.prepare is None else math.prepare(grad, state, hyper)
    direction = math.direction(x, state, hyper, step, *_split(math, split_rows))
    finish_step_(math, master, direction, state, hyper, master.shape, split_rows, lr, weight_decay)


def _whole_shape(piece: OwnedPiece) -> tuple[int, int]:
    return piece.full_shape if piece.state_over_tp else tuple(piece.param_shape or piece.master.shape)


def _exact_tp(piece: OwnedPiece, mode: str) -> bool:
    return piece.tp_size > 1 and piece.partition_dim is not None and mode != "blockwise"


@dataclass(frozen=True)
class _MatrixSteps:
    """The functions an UpdateRule of ``math`` needs, bound to its name, settings and TP mode."""

    name: str
    math: MatrixMath
    settings: type
    tp_mode_of: Callable[[object, object], str]
    tp_flag: str  # the flag that sets the TP mode, for messages

    # ------------------------------------------------------------------ set-up
    def _settings(self, config):
        return getattr(config, "rule_settings", {}).get(self.name) or self.settings()

    def tp_mode(self, config) -> str:
        return self.tp_mode_of(self._settings(config), config)

    def init(self, piece: OwnedPiece, settings) -> dict[str, Tensor]:
        settings = settings if settings is not None else self.settings()
        names = self.math.elementwise(settings) if callable(self.math.elementwise) else self.math.elementwise
        state = {name: torch.zeros_like(piece.master) for name in names}
        whole = self.math.init(_whole_shape(piece), settings)
        return state | {k: v.to(piece.master.device) for k, v in whole.items()}

    def check(self, piece: OwnedPiece, config) -> None:
        mode = self._known_mode(self.tp_mode(config))
        if piece.tp_size > 1 and mode != "blockwise":
            if piece.partition_dim not in (0, 1):
                raise ValueError(
                    f"{self.tp_flag} {mode}: {piece.name} is tensor-parallel but its split dimension "
                    "(partition_dim) is unknown; use blockwise"
                )
            if piece.split_rows is not None and piece.partition_dim != 0:
                raise ValueError(
                    f"{self.tp_flag} {mode}: {piece.name} splits Q, K and V but is not column-parallel "
                    "(partition_dim 0); use blockwise or --muon-no-split-qkv"
                )

    def over_tp(self, config) -> bool:
        return self.tp_mode(config) != "blockwise"

    def validate(self, config) -> None:
        """The hyper of ``config`` (its settings and shared fields, checked as they are read) and its TP mode."""
        settings = self._settings(config)
        if self.math.hyper is not None:
            self.math.hyper(settings, config)
        self._known_mode(self.tp_mode_of(settings, config))

    def _known_mode(self, mode: str) -> str:
        if mode not in self.math.tp_modes():
            modes = ", ".join(self.math.tp_modes())
            raise ValueError(f"{self.tp_flag} {mode}: {self.name} has no such TP mode; choose one of {modes}")
        return mode

    # ------------------------------------------------------------------ the math, hook by hook
    def hyper(self, ctx: StepContext):
        settings = ctx.settings if ctx.settings is not None else self._settings(ctx.config)
        return settings if self.math.hyper is None else self.math.hyper(settings, ctx.config)

    def _split(self, rows) -> tuple:
        return _split(self.math, rows)

    def _prepared(self, piece: OwnedPiece, hyper) -> Tensor:
        return piece.grad if self.math.prepare is None else self.math.prepare(piece.grad, piece.state, hyper)

    def _apply(self, piece: OwnedPiece, direction: Tensor, shape, rows, hyper, ctx: StepContext) -> None:
        finish_step_(self.math, piece.master, direction, piece.state, hyper, shape, rows, ctx.lr, ctx.weight_decay)

    def _one(self, piece: OwnedPiece, hyper, ctx: StepContext) -> None:
        step_matrix_(
            self.math,
            piece.master,
            piece.grad,
            piece.state,
            hyper,
            ctx.step,
            lr=ctx.lr,
            weight_decay=ctx.weight_decay,
            split_rows=piece.split_rows,
        )

    def _stack(self, pieces: Sequence[OwnedPiece], hyper, ctx: StepContext) -> None:
        """Same-shape pieces (and Q/K/V split) through ``batched``, one call per stack."""
        rows = pieces[0].split_rows
        inputs = torch.stack([self._prepared(p, hyper) for p in pieces])
        out = self.math.batched(inputs, [p.state for p in pieces], hyper, ctx.step, *self._split(rows))
        for piece, direction in zip(pieces, out.unbind(0)):
            self._apply(piece, direction, piece.master.shape, rows, hyper, ctx)

    def _exact(self, piece: OwnedPiece, mode: str, hyper, ctx: StepContext) -> None:
        """duplicated: the whole matrix's direction, this rank's slice of it; distributed: the shards in place."""
        x, shard = (
            self._prepared(piece, hyper),
            TpShard(
                piece.partition_dim,
                ctx.tp_group if piece.tp_group is None else piece.tp_group,
                piece.tp_size,
                piece.tp_rank,
            ),
        )
        split = self._split(piece.split_rows)
        if mode == "duplicated":
            whole = self.math.direction(gather_over_tp(x, shard.dim, shard.group), piece.state, hyper, ctx.step, *split)
            direction = whole.chunk(shard.size, dim=shard.dim)[shard.rank]
        else:
            direction = self.math.sharded(x, piece.state, hyper, ctx.step, shard, *split)
        self._apply(piece, direction, piece.full_shape, piece.split_rows, hyper, ctx)

    def _batches(self, device: str) -> bool:
        on = self.math.batched_on
        if FORCE_BATCHED is not None:
            return FORCE_BATCHED
        return BATCHED_ON.get(device, False) if on is None else device in on

    # ------------------------------------------------------------------ the steps
    @torch.no_grad()
    def step(self, pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
        """The owner's step: exact TP modes per matrix; the rest stacked by shape where batching pays
        (:data:`BATCHED_ON`), else one matrix at a time."""
        hyper, mode = self.hyper(ctx), self.tp_mode(ctx.config)
        local = [p for p in pieces if not _exact_tp(p, mode)]
        for p in pieces:
            if _exact_tp(p, mode):
                self._exact(p, mode, hyper, ctx)
        if not (local and self.math.batched is not None and self._batches(local[0].master.device.type)):
            for p in local:
                self._one(p, hyper, ctx)
            return
        for stack in stacks(local):
            self._stack(stack, hyper, ctx) if len(stack) > 1 else self._one(stack[0], hyper, ctx)

    @torch.no_grad()
    def even_step(self, pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
        """Per matrix of the group, in the same order on every rank (each gather is joined by all): the
        local slice prepared, the whole input gathered over the DP shard group, the whole matrix's math on
        each rank that holds a slice, its slice of the direction applied."""
        local, hyper = {p.global_name: p for p in pieces}, self.hyper(ctx)
        if len(local) != len(pieces):
            raise ValueError(f"{self.name}_even: a rank holds two slices of one parameter; the layout is not even")
        rank, world = group_rank(ctx.dp_group), group_size(ctx.dp_group)
        device = pieces[0].master.device if pieces else group_device(ctx.dp_group)
        for m in ctx.matrices:
            _check_even(self.name, m, world)
            piece = local.get(m.global_name)
            x = self._prepared(piece, hyper) if piece is not None else torch.empty(0, device=device)
            whole = gather_slices(x, m.bounds, ctx.dp_group).view(m.shape)
            if piece is None:
                continue
            rows = m.split_rows if self.math.qkv else None
            direction = self.math.direction(whole, piece.state, hyper, ctx.step, *self._split(rows))
            mine = direction.reshape(-1)[m.bounds[rank] : m.bounds[rank + 1]]
            self._apply(piece, mine, m.shape, rows, hyper, ctx)


def stacks(pieces: Sequence[OwnedPiece]) -> list[list[OwnedPiece]]:
    """Pieces of one shape and Q/K/V split, in order of first appearance, at most
    :data:`BATCH_ELEMENTS` elements per stack."""
    by_shape: dict[tuple, list[OwnedPiece]] = {}
    for p in pieces:
        by_shape.setdefault((tuple(p.master.shape), p.split_rows), []).append(p)
    out = []
    for (shape, _), group in by_shape.items():
        per_stack = max(1, BATCH_ELEMENTS // max(1, shape[0] * shape[1]))
        out.extend(group[i : i + per_stack] for i in range(0, len(group), per_stack))
    return out


def _check_even(name: str, m: GroupMatrix, world: int) -> None:
    if len(m.shape) != 2 or len(m.bounds) != world + 1:
        raise ValueError(
            f"{name}_even: {m.global_name} of shape {m.shape} with {len(m.bounds) - 1} shard bounds over a DP "
            f"shard group of {world}; it needs a 2D matrix split over that group"
        )


def tp_mode_field(rule: str, what: str):
    """The ``tp_mode`` field of a rule's settings without a sharded direction: ``--<rule>-tp-mode``,
    blockwise (the default: ``what`` on each TP shard, no communication) or duplicated (the whole matrix's
    ``what`` on every TP rank: the numbers of TP 1)."""
    return dataclasses.field(
        default="blockwise",
        metadata={
            "flag": f"--{rule}-tp-mode",
            "choices": TP_MODES[:2],
            "help": f"blockwise: {what} on each TP-local shard (no communication; the numbers depend on the TP "
            f"size); duplicated: the gradient all-gathered over TP and the whole matrix's {what} on every TP rank "
            "(the numbers of TP 1)",
        },
    )


def settings_tp_mode(settings, config) -> str:
    """The TP mode of a rule whose settings have a ``tp_mode`` field (its ``--<rule>-tp-mode`` flag)."""
    return settings.tp_mode


def matrix_rule(
    name: str,
    math: MatrixMath,
    *,
    settings: type,
    cost: Callable,
    state_bytes: Callable,
    optimizer: str | None = None,
    elementwise: Callable[[object], str] | str | None = "adamw",
    tp_mode: Callable[[object, object], str] = settings_tp_mode,
    tp_flag: str | None = None,
    splits_qkv: Callable[[object], bool] = never,
    check: Callable[[OwnedPiece, object], None] | None = None,
    describe: Callable[[object], str] | None = None,
    reshard: tuple[str, ...] | None = None,
) -> UpdateRule:
    """The owner rule of ``math``, its even variant in ``even``. ``cost`` and ``state_bytes`` are the
    planner's (shape, split_rows, CostContext) -> multiply-adds and (shape, CostContext) -> bytes;
    ``tp_mode`` (settings, config) -> one of :data:`TP_MODES` (default: the settings' ``tp_mode`` field, set
    by ``tp_flag``, default ``--<name>-tp-mode``);
    ``splits_qkv`` whether, under a config, Q, K and V are updated apart (the hooks then take the split);
    ``check`` the rule's own validation of a piece at set-up, after the TP checks every rule gets;
    ``reshard`` every name the elementwise state may have (needed where ``math.elementwise`` is a function)."""
    if reshard is None and callable(math.elementwise):
        raise TypeError(f"matrix rule {name!r}: name every elementwise state it may keep (reshard=...)")
    reshard = math.elementwise if reshard is None else reshard
    if math.qkv != (splits_qkv is not never):
        raise TypeError(f"matrix rule {name!r}: a math that updates Q, K and V apart (qkv) says when (splits_qkv)")
    if tp_mode is settings_tp_mode and "tp_mode" not in {f.name for f in dataclasses.fields(settings)}:
        raise TypeError(f"matrix rule {name!r}: its settings {settings.__name__} need a tp_mode field")
    steps = _MatrixSteps(name, math, settings, tp_mode, tp_flag or f"--{name}-tp-mode")

    def checked(piece: OwnedPiece, config) -> None:
        steps.check(piece, config)
        if check is not None:
            check(piece, config)

    common = dict(state=steps.init, state_bytes=state_bytes, settings=settings, splits_qkv=splits_qkv, reshard=reshard)
    even = UpdateRule(
        name=f"{name}_even",
        storage=SLICE,
        step=steps.even_step,
        collective=True,
        family=name,
        **common,  # state_bytes per holder: every rank that holds a slice keeps the whole-matrix state
    )
    return UpdateRule(
        name=name,
        storage=WHOLE,
        step=steps.step,
        cost=cost,
        optimizer=optimizer,
        elementwise=elementwise,
        check=checked,
        state_over_tp=steps.over_tp,
        validate=steps.validate,
        even=even,
        describe=describe,
        **common,
    )
