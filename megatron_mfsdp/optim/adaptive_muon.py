"""Adaptive Muon: Muon's orthogonalized update normalized by a second moment (AdaMuon, NorMuon).

Megatron-LM HEAD's ``--optimizer adaptive_muon`` builds ``TensorParallelAdaptiveMuon``
(megatron/core/optimizer/emerging_optimizers.py) on Emerging-Optimizers' ``AdaptiveMuon``
(emerging_optimizers/orthogonalized_optimizers/adaptive_muon.py, v0.3.0, the version Megatron-LM
pins), with ``moment2_method``, ``beta2`` and ``eps`` from the OptimizerConfig fields
``adaptive_muon_*`` and Muon's settings from the ``muon_*`` fields. Per matrix and step:

    param <- param * (1 - lr * wd)                         decoupled weight decay
    m <- lerp(m, g, 1 - momentum); d = lerp(g, m, momentum) Muon's momentum, Nesterov (or d = m)
    O = NS(d)                                              raw Newton-Schulz, Q, K, V apart with --muon-split-qkv
    adamuon: v <- lerp(v, O^2, 1 - beta2)                  v elementwise, param-shaped
             U = O / (sqrt(v) + eps)
    normuon: r = mean(O^2 over columns if rows >= cols, else over rows)
             v <- lerp(v, r, 1 - beta2)                    v per row (rows, 1) or per column (1, cols)
             U = O * rsqrt(max(v, eps));  U <- U * |O|_F / max(|U|_F, eps)
    param <- param - lr * scale(rows, cols) * U            --muon-scale-mode x --muon-extra-scale-factor

The Newton-Schulz kernels, coefficients, dtype and scale modes are muon.py's. The second moment and
the final scale see the whole matrix (the whole linear_qkv with --muon-split-qkv), as in Megatron.

Where Megatron-LM HEAD differs (read, not guessed): its ``TensorParallelAdaptiveMuon`` orthogonalizes
with ``TensorParallelMuon``'s function, which already multiplies each block by Muon's scale, and then
``AdaptiveMuon.step`` scales again after the second moment; Emerging-Optimizers' own ``AdaptiveMuon``
(since its "fix normuon" change) normalizes the raw Newton-Schulz output and scales once. We scale
once; ``--adaptive-muon-prescale`` also scales each block before the second moment, Megatron-LM
HEAD's numbers (for adamuon that only moves eps; for normuon it multiplies the update by the block's
scale). Under TP, Megatron normalizes and scales each rank's shard; our ``duplicated`` and
``distributed`` modes (--muon-tp-mode) give the whole matrix's numbers, the same at every TP size
(``blockwise`` steps each shard on its own, as Megatron's). Megatron decays by
``param.add_(param, alpha=-lr * wd)``; we multiply by ``1 - lr * wd`` as muon.py does (one rounding
apart). Megatron-LM HEAD has the OptimizerConfig fields but no command-line flags for them; our flags
are the fields' names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..groups import group_rank
from ..placement.classes import SLICE, WHOLE
from .matrix import gather_over_tp, settings_in
from .muon import (
    apply_update_,
    merge_qkv,
    momentum_direction_,
    orthogonalize,
    rule_cost,
    scalar_rule,
    split_qkv,
    splits_qkv,
    step_kwargs,
    update_scale,
)
from .muon import (
    describe as describe_muon,
)
from .muon_even import gather_slices, group_device
from .muon_tp import TP_MODES, distributed_newton_schulz
from .rule import CostContext, OwnedPiece, StepContext, UpdateRule

NAME = "adaptive_muon"
METHODS = ("adamuon", "normuon")
ADAMUON_STATE, NORMUON_STATE = "moment2_buffer", "normuon_moment2_buffer"
"""adamuon's v is param-shaped (split like the parameter in checkpoints, Emerging-Optimizers' name);
normuon's is one value per row or column, saved whole under its matrix's name."""
MOMENT2_OPS_PER_ELEMENT = 6
"""The planner's count of the second moment's elementwise work per matrix element (square, lerp, sqrt
or rsqrt, add, divide or multiply, the norms)."""


@dataclass
class AdaptiveMuonSettings:
    """Adaptive Muon's second moment (Megatron-LM HEAD's OptimizerConfig adaptive_muon_* fields)"""

    adaptive_muon_moment2_method: str = field(
        default="adamuon",
        metadata={"choices": METHODS, "help": "adamuon: elementwise second moment; normuon: per row (or column)"},
    )
    adaptive_muon_beta2: float = field(default=0.95, metadata={"help": "decay of the second moment's EMA"})
    adaptive_muon_eps: float = field(default=1e-8, metadata={"help": "adamuon: added to sqrt(v); normuon: v floor"})
    adaptive_muon_prescale: bool = field(
        default=False,
        metadata={
            "help": "also apply Muon's scale to each Newton-Schulz block before the second moment, as Megatron-LM "
            "HEAD's TensorParallelAdaptiveMuon does (Emerging-Optimizers' AdaptiveMuon scales once, after)"
        },
    )

    def __post_init__(self):
        if self.adaptive_muon_moment2_method not in METHODS:
            raise ValueError(
                f"--adaptive-muon-moment2-method {self.adaptive_muon_moment2_method!r}: choose one of "
                f"{', '.join(METHODS)}"
            )
        if not 0.0 <= self.adaptive_muon_beta2 < 1.0:
            raise ValueError(f"--adaptive-muon-beta2 {self.adaptive_muon_beta2}: must be in [0, 1)")
        if not self.adaptive_muon_eps > 0.0:
            raise ValueError(f"--adaptive-muon-eps {self.adaptive_muon_eps}: must be positive")


def moment2_shape(shape: Sequence[int], method: str) -> tuple[int, ...]:
    """The second moment's shape for a (rows, cols) matrix: the matrix's, or normuon's one value per
    row when rows >= cols, else per column (Emerging-Optimizers' ``_init_group``)."""
    rows, cols = int(shape[0]), int(shape[1])
    if method == "adamuon":
        return (rows, cols)
    return (rows, 1) if rows >= cols else (1, cols)


def normuon_axis(shape: Sequence[int]) -> int:
    """The axis normuon averages O^2 over: the columns (1) when rows >= cols, else the rows (0)."""
    return 1 if shape[0] >= shape[1] else 0


def adamuon_normalize_(orth: Tensor, moment2: Tensor, beta2: float, eps: float) -> Tensor:
    """v <- lerp(v, O^2, 1 - beta2) in place; O / (sqrt(v) + eps)."""
    moment2.lerp_(orth.square(), 1 - beta2)
    return orth / (moment2.sqrt() + eps)


def match_frobenius(update: Tensor, reference: Tensor, eps: float) -> Tensor:
    """``update`` rescaled to the Frobenius norm of ``reference`` (its norm floored at eps)."""
    return update * (torch.linalg.vector_norm(reference) / torch.linalg.vector_norm(update).clamp_min(eps))


def normuon_normalize_(orth: Tensor, moment2: Tensor, beta2: float, eps: float) -> Tensor:
    """v <- lerp(v, mean(O^2 along :func:`normuon_axis`), 1 - beta2) in place; O * rsqrt(max(v, eps)),
    rescaled to O's Frobenius norm."""
    moment2.lerp_(orth.square().mean(dim=normuon_axis(orth.shape), keepdim=True), 1 - beta2)
    return match_frobenius(orth * moment2.clamp_min(eps).rsqrt_(), orth, eps)


def normalize_(orth: Tensor, moment2: Tensor, settings: AdaptiveMuonSettings) -> Tensor:
    """The second moment's update and normalization of ``settings``' method."""
    fn = adamuon_normalize_ if settings.adaptive_muon_moment2_method == "adamuon" else normuon_normalize_
    return fn(orth, moment2, settings.adaptive_muon_beta2, settings.adaptive_muon_eps)


def normuon_normalize_tp_(
    orth: Tensor, moment2: Tensor, settings: AdaptiveMuonSettings, partition_dim: int, group, full_shape
) -> Tensor:
    """:func:`normuon_normalize_` of the matrix whose shards along ``partition_dim`` are spread over the TP
    ``group`` (this rank holds ``orth``'s), with ``moment2`` of the whole matrix on every rank: the row
    (or column) means are all-reduced or gathered, the two Frobenius norms all-reduced."""
    beta2, eps = settings.adaptive_muon_beta2, settings.adaptive_muon_eps
    axis, world = normuon_axis(full_shape), dist.get_world_size(group)
    square = orth.square()
    if axis == partition_dim:  # the mean runs across the shards
        mean = square.sum(dim=axis, keepdim=True)
        dist.all_reduce(mean, group=group)
        mean.div_(full_shape[axis])
    else:
        mean = gather_over_tp(square.mean(dim=axis, keepdim=True), partition_dim, group)
    moment2.lerp_(mean, 1 - beta2)
    step_size = moment2.clamp_min(eps).rsqrt_()
    if axis != partition_dim:
        step_size = step_size.chunk(world, dim=partition_dim)[dist.get_rank(group)]
    update = orth * step_size
    norms = torch.stack([update.square().sum(), square.sum()])
    dist.all_reduce(norms, group=group)
    update_norm, orth_norm = norms.sqrt().unbind(0)
    return update * (orth_norm / update_norm.clamp_min(eps))


@dataclass(frozen=True)
class AdaptiveMuonStep:
    """What a step takes besides the tensors: Muon's settings as muon.py reads them
    (:func:`muon.step_kwargs`) and the second moment's."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_steps: int
    coefficient_type: str
    ns_dtype: torch.dtype
    ns_algorithm: str
    scale_mode: str
    extra_scale_factor: float
    settings: AdaptiveMuonSettings

    @classmethod
    def of(cls, ctx: StepContext) -> AdaptiveMuonStep:
        return cls(**step_kwargs(ctx), settings=ctx.settings or settings_in(ctx.config, NAME, AdaptiveMuonSettings))

    def ns(self, block: Tensor) -> Tensor:
        return orthogonalize(block, self.ns_steps, self.coefficient_type, self.ns_dtype, self.ns_algorithm)

    def scale(self, shape: Sequence[int]) -> float:
        return update_scale(tuple(shape), self.scale_mode, self.extra_scale_factor)

    def prescale(self, full: Callable[[tuple], tuple] = tuple) -> Callable[[tuple], float] | None:
        """Megatron-LM HEAD's scale of a block before the second moment (of the block's ``full`` shape), or None."""
        return (lambda shape: self.scale(full(shape))) if self.settings.adaptive_muon_prescale else None


def orthogonalized(
    direction: Tensor, split_rows, ns_block: Callable[[Tensor], Tensor], prescale: Callable | None
) -> Tensor:
    """``ns_block`` of the whole direction, or of its Q, K and V blocks apart (``split_rows``) merged back;
    with ``prescale`` each block times its scale (:meth:`AdaptiveMuonStep.prescale`)."""
    blocks = split_qkv(direction, split_rows) if split_rows else [direction]
    out = []
    for block in blocks:
        orth = ns_block(block)
        out.append(orth.mul_(prescale(tuple(block.shape))) if prescale is not None else orth)
    return merge_qkv(out, split_rows, tuple(direction.shape)) if split_rows else out[0]


@torch.no_grad()
def adaptive_muon_step_(
    param: Tensor, grad: Tensor, momentum_buffer: Tensor, moment2: Tensor, split_rows, cfg: AdaptiveMuonStep
) -> None:
    """One step of a whole (or TP-local, blockwise) matrix, in place on the fp32 master and the state."""
    direction = momentum_direction_(grad, momentum_buffer, cfg.momentum, cfg.nesterov)
    update = normalize_(orthogonalized(direction, split_rows, cfg.ns, cfg.prescale()), moment2, cfg.settings)
    apply_update_(param, update, -cfg.lr * cfg.scale(param.shape), cfg.lr, cfg.weight_decay)


def _moment2(piece: OwnedPiece) -> Tensor:
    return piece.state[ADAMUON_STATE] if ADAMUON_STATE in piece.state else piece.state[NORMUON_STATE]


def _duplicated_update(piece: OwnedPiece, direction: Tensor, cfg: AdaptiveMuonStep, group) -> Tensor:
    """The whole direction gathered over TP and orthogonalized on every TP rank; normuon normalizes the
    whole matrix with its whole v, adamuon this rank's shard (elementwise): TP = 1's numbers."""
    dim, rank = piece.partition_dim, piece.tp_rank
    orth = orthogonalized(gather_over_tp(direction, dim, group), piece.split_rows, cfg.ns, cfg.prescale())
    if ADAMUON_STATE in piece.state:
        return normalize_(orth.chunk(piece.tp_size, dim=dim)[rank], _moment2(piece), cfg.settings)
    return normalize_(orth, _moment2(piece), cfg.settings).chunk(piece.tp_size, dim=dim)[rank]


def _distributed_update(piece: OwnedPiece, direction: Tensor, cfg: AdaptiveMuonStep, group) -> Tensor:
    """Muon's distributed Newton-Schulz (muon_tp.py: a Gram all-reduce per iteration, shards in place),
    then the second moment of the whole matrix: adamuon on the shard, normuon with its statistics
    reduced over TP (:func:`normuon_normalize_tp_`)."""
    dim, tp_size = piece.partition_dim, piece.tp_size

    def full(shape):
        return tuple(s * tp_size if i == dim else s for i, s in enumerate(shape))

    def ns_block(block):
        return distributed_newton_schulz(block, dim, group, cfg.ns_steps, cfg.coefficient_type, cfg.ns_dtype)

    orth = orthogonalized(direction, piece.split_rows, ns_block, cfg.prescale(full))
    if ADAMUON_STATE in piece.state:
        return normalize_(orth, _moment2(piece), cfg.settings)
    return normuon_normalize_tp_(orth, _moment2(piece), cfg.settings, dim, group, piece.full_shape)


def _exact_tp(piece: OwnedPiece, config) -> bool:
    return piece.tp_size > 1 and piece.partition_dim is not None and config.muon_tp_mode != "blockwise"


@torch.no_grad()
def step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """Each owned matrix on its own (no collective but the TP modes'): blockwise (and TP = 1) steps the
    matrix this rank holds; duplicated and distributed give the whole TP-split matrix's numbers."""
    cfg = AdaptiveMuonStep.of(ctx)
    for p in pieces:
        if not _exact_tp(p, ctx.config):
            adaptive_muon_step_(p.master, p.grad, p.state["momentum_buffer"], _moment2(p), p.split_rows, cfg)
            continue
        direction = momentum_direction_(p.grad, p.state["momentum_buffer"], cfg.momentum, cfg.nesterov)
        update_of = _duplicated_update if ctx.config.muon_tp_mode == "duplicated" else _distributed_update
        update = update_of(p, direction, cfg, ctx.tp_group)
        apply_update_(p.master, update, -cfg.lr * cfg.scale(p.full_shape), cfg.lr, cfg.weight_decay)


@torch.no_grad()
def even_step(pieces: Sequence[OwnedPiece], ctx: StepContext) -> None:
    """--mfsdp-layout even (muon_even.py's reconstruction): momentum on the local slice, the directions
    gathered over the DP shard group (every rank joins each gather), then on each holder the owner's math
    on the whole matrix, keeping its slice: adamuon's v is the slice's, normuon's the whole matrix's
    (replicated on every holder)."""
    cfg = AdaptiveMuonStep.of(ctx)
    local, rank = {p.global_name: p for p in pieces}, group_rank(ctx.dp_group)
    device = pieces[0].master.device if pieces else group_device(ctx.dp_group)
    for m in ctx.matrices:
        piece = local.get(m.global_name)
        if piece is None:
            gather_slices(torch.empty(0, device=device), m.bounds, ctx.dp_group)
            continue
        direction = momentum_direction_(piece.grad, piece.state["momentum_buffer"], cfg.momentum, cfg.nesterov)
        full = gather_slices(direction, m.bounds, ctx.dp_group).view(m.shape)
        orth, mine = orthogonalized(full, m.split_rows, cfg.ns, cfg.prescale()), slice(*m.bounds[rank : rank + 2])
        if ADAMUON_STATE in piece.state:
            update = normalize_(orth.reshape(-1)[mine], _moment2(piece), cfg.settings)
        else:
            update = normalize_(orth, _moment2(piece), cfg.settings).reshape(-1)[mine]
        apply_update_(piece.master, update, -cfg.lr * cfg.scale(m.shape), cfg.lr, cfg.weight_decay)


def init_state(piece: OwnedPiece, settings: AdaptiveMuonSettings | None) -> dict[str, Tensor]:
    """Muon's momentum, shaped like the piece; adamuon's v shaped like it too; normuon's of the matrix
    (the whole TP-split matrix under an exact TP mode, the whole matrix for an even slice)."""
    s = settings or AdaptiveMuonSettings()
    state = {"momentum_buffer": torch.zeros_like(piece.master)}
    if s.adaptive_muon_moment2_method == "adamuon":
        state[ADAMUON_STATE] = torch.zeros_like(piece.master)
    else:
        shape = piece.full_shape if piece.state_over_tp else tuple(piece.param_shape or piece.master.shape)
        state[NORMUON_STATE] = torch.zeros(moment2_shape(shape, "normuon"), device=piece.master.device)
    return state


def check(piece: OwnedPiece, cfg) -> None:
    """Refuse at set-up what the step cannot do exactly, naming the flag."""
    if piece.split_rows is not None and len(piece.split_rows) == 1:
        raise ValueError(
            f"--optimizer {NAME}: {piece.name} is a Q, K or V block placed apart (--mfsdp-split-qkv-owners), but the "
            "second moment and the scale are of the whole linear_qkv; use --mfsdp-split-qkv-owners whole"
        )
    if piece.tp_size > 1 and cfg.muon_tp_mode != "blockwise":
        if piece.partition_dim not in (0, 1):
            raise ValueError(
                f"--muon-tp-mode {cfg.muon_tp_mode}: {piece.name} is tensor-parallel but its split dimension "
                "(partition_dim) is unknown; use blockwise"
            )
        if piece.split_rows is not None and piece.partition_dim != 0:
            raise ValueError(
                f"--muon-tp-mode {cfg.muon_tp_mode}: {piece.name} splits Q, K and V but is not column-parallel "
                "(partition_dim 0); use blockwise or --muon-no-split-qkv"
            )
    if cfg.muon_tp_mode not in TP_MODES:
        raise ValueError(f"unknown --muon-tp-mode {cfg.muon_tp_mode!r}; choose one of {', '.join(TP_MODES)}")


def _settings(config) -> AdaptiveMuonSettings:
    return settings_in(config, NAME, AdaptiveMuonSettings)


def state_over_tp(config) -> bool:
    """normuon's v is of the whole TP-split matrix under duplicated and distributed (alike on every TP
    rank); adamuon's is elementwise, the shard's in every mode."""
    return _settings(config).adaptive_muon_moment2_method == "normuon" and config.muon_tp_mode != "blockwise"


def cost(shape: Sequence[int], split_rows, context: CostContext) -> int:
    """Muon's Newton-Schulz multiply-adds plus the second moment's elementwise work."""
    return rule_cost(shape, split_rows, context) + MOMENT2_OPS_PER_ELEMENT * int(shape[0]) * int(shape[1])


def state_bytes(shape: Sequence[int], context: CostContext) -> int:
    """fp32 momentum plus the second moment (param-shaped, or one value per row or column)."""
    method = _settings(context.config).adaptive_muon_moment2_method
    v_shape = moment2_shape(shape, method)
    return 4 * (int(shape[0]) * int(shape[1]) + v_shape[0] * v_shape[1])


EVEN = UpdateRule(
    name=f"{NAME}_even",
    storage=SLICE,
    state=init_state,
    step=even_step,
    reshard=("momentum_buffer", ADAMUON_STATE),
    splits_qkv=splits_qkv,
    even_layout_of=NAME,
    collective=True,
    family=NAME,
)


def describe(config) -> str:
    """The start-up line's account: Muon's Newton-Schulz run and the second moment's settings."""
    s = _settings(config)
    return (
        f"{describe_muon(config)}, second moment {s.adaptive_muon_moment2_method} (beta2 {s.adaptive_muon_beta2}, "
        f"eps {s.adaptive_muon_eps})"
    )


RULE = UpdateRule(
    name=NAME,
    storage=WHOLE,
    state=init_state,
    step=step,
    cost=cost,
    state_bytes=state_bytes,
    settings=AdaptiveMuonSettings,
    optimizer=NAME,
    elementwise=scalar_rule,
    reshard=("momentum_buffer", ADAMUON_STATE),
    splits_qkv=splits_qkv,
    check=check,
    state_over_tp=state_over_tp,
    even=EVEN,
    describe=describe,
)
