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

The Newton-Schulz kernels, coefficients, dtype and scale modes are muon.py's; like Muon it is a
:class:`~.matrix.MatrixMath` (the momentum ``prepare``, adamuon's normalization ``finish``: both
elementwise; normuon's inside the direction, its v of the whole matrix), so matrix.py gives it the
loop, the stacks, the TP modes and the even variant. The second moment and the final scale see the
whole matrix (the whole linear_qkv with --muon-split-qkv), as in Megatron.

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

from . import muon
from .matrix import MatrixMath, TpShard, gather_over_tp, matrix_rule
from .rule import CostContext, OwnedPiece

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
    return 1 if shape[-2] >= shape[-1] else 0


def adamuon_normalize_(orth: Tensor, moment2: Tensor, beta2: float, eps: float) -> Tensor:
    """v <- lerp(v, O^2, 1 - beta2) in place; O / (sqrt(v) + eps)."""
    moment2.lerp_(orth.square(), 1 - beta2)
    return orth / (moment2.sqrt() + eps)


def match_frobenius(update: Tensor, reference: Tensor, eps: float) -> Tensor:
    """``update`` rescaled to the Frobenius norm of ``reference`` (its norm floored at eps); per matrix of a stack."""
    if update.dim() == 2:
        return update * (torch.linalg.vector_norm(reference) / torch.linalg.vector_norm(update).clamp_min(eps))
    norm = lambda x: torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)  # noqa: E731
    return update * (norm(reference) / norm(update).clamp_min(eps))


def normuon_normalize_(orth: Tensor, moment2: Tensor, beta2: float, eps: float) -> Tensor:
    """v <- lerp(v, mean(O^2 along :func:`normuon_axis`), 1 - beta2) in place; O * rsqrt(max(v, eps)),
    rescaled to O's Frobenius norm (a matrix, or a stack with its stacked v)."""
    moment2.lerp_(orth.square().mean(dim=normuon_axis(orth.shape) - 2, keepdim=True), 1 - beta2)
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
class AdaptiveMuonHyper:
    """What a step reads: Muon's (muon.hyper_in: the same OptimizerConfig fields and settings) and the
    second moment's settings."""

    muon: muon.MuonHyper
    settings: AdaptiveMuonSettings

    @classmethod
    def of(cls, settings: AdaptiveMuonSettings, config) -> AdaptiveMuonHyper:
        return cls(muon.hyper_in(config), settings or AdaptiveMuonSettings())

    @property
    def adamuon(self) -> bool:
        return self.settings.adaptive_muon_moment2_method == "adamuon"

    def prescale(self, full: Callable[[tuple], tuple] = tuple) -> Callable[[tuple], float] | None:
        """Megatron-LM HEAD's scale of a block before the second moment (of the block's ``full`` shape), or None."""
        return (lambda shape: self.muon.scale(full(shape))) if self.settings.adaptive_muon_prescale else None


def prepare(grad: Tensor, state: dict[str, Tensor], hyper: AdaptiveMuonHyper) -> Tensor:
    """Muon's momentum, elementwise."""
    return muon.prepare(grad, state, hyper.muon)


def direction(x: Tensor, state: dict[str, Tensor], hyper: AdaptiveMuonHyper, step: int, split_rows) -> Tensor:
    """The orthogonalized direction (Q, K and V apart with the split, each prescaled if asked); normuon
    normalizes it here with the whole matrix's v, adamuon in :func:`finish`."""
    orth = muon.orthogonalized(x, split_rows, hyper.muon.ns, hyper.prescale())
    return orth if hyper.adamuon else normalize_(orth, state[NORMUON_STATE], hyper.settings)


def batched(stack: Tensor, states, hyper: AdaptiveMuonHyper, step: int, split_rows) -> Tensor:
    """:func:`direction` of a (B, rows, cols) stack: one batched Newton-Schulz; normuon's v of each matrix
    stacked for the normalization and written back."""
    orth = muon.orthogonalized(stack, split_rows, hyper.muon.ns, hyper.prescale())
    if hyper.adamuon:
        return orth
    moment2 = torch.stack([s[NORMUON_STATE] for s in states])
    out = normalize_(orth, moment2, hyper.settings)
    for s, v in zip(states, moment2.unbind(0)):
        s[NORMUON_STATE].copy_(v)
    return out


def sharded(x: Tensor, state, hyper: AdaptiveMuonHyper, step: int, shard: TpShard, split_rows) -> Tensor:
    """--muon-tp-mode distributed: Muon's sharded Newton-Schulz, then normuon with its statistics reduced over
    TP (:func:`normuon_normalize_tp_`; adamuon normalizes the shard in :func:`finish`)."""
    ns = lambda block: hyper.muon.ns.sharded(block, shard.dim, shard.group)  # noqa: E731
    orth = muon.orthogonalized(x, split_rows, ns, hyper.prescale(shard.full))
    if hyper.adamuon:
        return orth
    return normuon_normalize_tp_(
        orth, state[NORMUON_STATE], hyper.settings, shard.dim, shard.group, shard.full(x.shape)
    )


def finish(y: Tensor, state: dict[str, Tensor], hyper: AdaptiveMuonHyper) -> Tensor:
    """adamuon's elementwise second moment, on whatever part of the matrix this rank steps."""
    return normalize_(y, state[ADAMUON_STATE], hyper.settings) if hyper.adamuon else y


def scale(shape: Sequence[int], hyper: AdaptiveMuonHyper, split_rows) -> float:
    """Muon's scale of the whole matrix, after the second moment."""
    return hyper.muon.scale(shape)


def elementwise_state(settings: AdaptiveMuonSettings) -> tuple[str, ...]:
    """Muon's momentum, and adamuon's v: shaped like the part of the matrix a rank steps."""
    return (muon.STATE,) + ((ADAMUON_STATE,) if settings.adaptive_muon_moment2_method == "adamuon" else ())


def init(shape, settings: AdaptiveMuonSettings) -> dict[str, Tensor]:
    """normuon's v, of the whole matrix (the whole TP-split matrix under an exact TP mode)."""
    if settings.adaptive_muon_moment2_method == "adamuon":
        return {}
    return {NORMUON_STATE: torch.zeros(moment2_shape(shape, "normuon"))}


def check(piece: OwnedPiece, cfg) -> None:
    """Refuse at set-up what the step cannot do exactly, naming the flag (after matrix.py's TP checks)."""
    if piece.split_rows is not None and len(piece.split_rows) == 1:
        raise ValueError(
            f"--optimizer {NAME}: {piece.name} is a Q, K or V block placed apart (--mfsdp-split-qkv-owners), but the "
            "second moment and the scale are of the whole linear_qkv; use --mfsdp-split-qkv-owners whole"
        )


def cost(shape: Sequence[int], split_rows, context: CostContext) -> int:
    """Muon's Newton-Schulz multiply-adds plus the second moment's elementwise work."""
    return muon.rule_cost(shape, split_rows, context) + MOMENT2_OPS_PER_ELEMENT * int(shape[0]) * int(shape[1])


def state_bytes(shape: Sequence[int], context: CostContext) -> int:
    """fp32 momentum plus the second moment (param-shaped, or one value per row or column)."""
    v_shape = moment2_shape(shape, RULE.settings_in(context.config).adaptive_muon_moment2_method)
    return 4 * (int(shape[0]) * int(shape[1]) + v_shape[0] * v_shape[1])


def describe(config) -> str:
    """The start-up line's account: Muon's Newton-Schulz run and the second moment's settings."""
    s = RULE.settings_in(config)
    return (
        f"{muon.describe(config)}, second moment {s.adaptive_muon_moment2_method} (beta2 {s.adaptive_muon_beta2}, "
        f"eps {s.adaptive_muon_eps})"
    )


MATH = MatrixMath(
    direction=direction,
    init=init,
    hyper=AdaptiveMuonHyper.of,
    elementwise=elementwise_state,
    prepare=prepare,
    finish=finish,
    scale=scale,
    batched=batched,
    sharded=sharded,
    qkv=True,
)

RULE = matrix_rule(
    NAME,
    MATH,
    settings=AdaptiveMuonSettings,
    cost=cost,
    state_bytes=state_bytes,
    optimizer=NAME,
    elementwise=muon.scalar_rule,
    tp_mode=lambda settings, config: muon.hyper_in(config).tp_mode,
    tp_flag="--muon-tp-mode",
    splits_qkv=muon.splits_qkv,
    check=check,
    describe=describe,
    reshard=(muon.STATE, ADAMUON_STATE),
)
