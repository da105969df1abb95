"""Muon: momentum, then each matrix orthogonalized by Newton-Schulz and scaled by its shape.

Written as a :class:`~.matrix.MatrixMath`: the momentum is elementwise (``prepare``: kept for
whatever part of a matrix a rank holds, split like the parameter in checkpoints); the direction is
the Newton-Schulz of the momentum direction (newton_schulz.py), of Q, K and V apart with
--muon-split-qkv; the shape scale is folded into the learning rate as torch.optim.Muon folds it.
matrix.py gives it the per-matrix loop, the stacks, the TP modes (``distributed``: the sharded
Newton-Schulz, :func:`sharded`) and the even variant. :func:`muon_step_` is the same math on one
matrix as a function: the reference the tests and baselines step with, bitwise torch.optim.Muon's.

Its settings are megatron-core's OptimizerConfig fields (``muon_momentum``, ``muon_use_nesterov``,
``muon_num_ns_steps``, ``muon_scale_mode``, ``muon_extra_scale_factor``, ``muon_tp_mode``: read in
:meth:`MuonHyper.of`; ``muon_split_qkv``: :func:`splits_qkv`) and ours, :class:`MuonSettings`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .matrix import TP_MODES, MatrixMath, TpShard, matrix_rule, step_matrix_
from .newton_schulz import (
    NS_ALGORITHMS,
    NS_COEFFICIENTS,
    NS_DTYPES,
    SYMMETRIC_MIN_ROWS,
    NewtonSchulz,
    auto_may_use_gram,
    newton_schulz_cost,
)
from .rule import CostContext

NAME = "muon"
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
STATE = "momentum_buffer"  # torch.optim.Muon's and megatron-core's name


def update_scale(shape: Sequence[int], mode: str, extra_scale_factor: float) -> float:
    """Scale of an orthogonalized update of a (rows=m, cols=n) matrix.

    spectral: sqrt(max(m, n)) (with 0.2 == torch's "match_rms_adamw");
    shape_scaling: sqrt(max(1, m/n)) (torch's "original");
    unit_rms_norm: sqrt(m/n). All multiplied by ``extra_scale_factor``.
    """
    m, n = int(shape[0]), int(shape[1])
    if mode == "spectral":
        ratio = math.sqrt(max(m, n))
    elif mode == "shape_scaling":
        ratio = math.sqrt(max(1, m / n))
    elif mode == "unit_rms_norm":
        ratio = math.sqrt(m / n)
    else:
        valid = ", ".join(repr(k) for k in SCALE_MODES)
        raise ValueError(f"unknown Muon scale mode {mode!r} (--muon-scale-mode); choose one of {valid}")
    return ratio * extra_scale_factor


def _qkv_groups(rows: int, split_shapes: Sequence[int]) -> int:
    """Query groups of a matrix split by ``split_shapes``: 3 (Q, K, V of linear_qkv), or 1 for a Q, K
    or V block that has an owner of its own (placement/blocks.py), stepped in the split op order."""
    if len(split_shapes) not in (1, 3) or any(int(s) <= 0 for s in split_shapes):
        raise ValueError(f"qkv split shapes must be 3 (or 1, one block) positive ints, got {tuple(split_shapes)}")
    per_group = sum(int(s) for s in split_shapes)
    if rows % per_group != 0:
        raise ValueError(
            f"linear_qkv rows ({rows}) are not divisible by sum of qkv split shapes {tuple(split_shapes)} = {per_group}"
        )
    return rows // per_group


def split_qkv(matrix: Tensor, split_shapes: Sequence[int]) -> list[Tensor]:
    """Split a grouped linear_qkv weight (or a stack of them) into its Q, K and V matrices.

    megatron-core lays rows out per query group as [q rows, k rows, v rows]; like
    megatron-core's TensorParallelMuon, each part is reshaped to (groups * rows_i, cols).
    """
    if matrix.dim() not in (2, 3):
        raise ValueError(f"split_qkv expects a 2D matrix or a stack of them, got shape {tuple(matrix.shape)}")
    *lead, rows, cols = matrix.shape
    groups = _qkv_groups(rows, split_shapes)
    parts = torch.split(matrix.reshape(*lead, groups, rows // groups, cols), [int(s) for s in split_shapes], dim=-2)
    return [p.reshape(*lead, -1, cols) for p in parts]


def merge_qkv(parts: Sequence[Tensor], split_shapes: Sequence[int], shape: Sequence[int]) -> Tensor:
    """Exact inverse of :func:`split_qkv`: interleave Q, K, V back per query group."""
    *lead, rows, cols = (int(d) for d in shape)
    groups = _qkv_groups(rows, split_shapes)
    if len(parts) != len(split_shapes):
        raise ValueError(f"merge_qkv expects {len(split_shapes)} parts, got {len(parts)}")
    blocks = []
    for part, s in zip(parts, split_shapes):
        if tuple(part.shape) != (*lead, groups * int(s), cols):
            raise ValueError(f"qkv part shape {tuple(part.shape)} != {(*lead, groups * int(s), cols)}")
        blocks.append(part.reshape(*lead, groups, int(s), cols))
    return torch.cat(blocks, dim=-2).reshape(*lead, rows, cols)


def momentum_direction_(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """EMA momentum in place (``lerp_``, as torch.optim.Muon), then the direction to
    orthogonalize: Nesterov's ``grad.lerp(buf, momentum)`` or the buffer itself."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


@dataclass
class MuonSettings:
    """Muon's Newton-Schulz run, beyond megatron-core 0.16.1's OptimizerConfig muon_* fields"""

    muon_coefficient_type: str = field(
        default="quintic",
        metadata={
            "choices": tuple(NS_COEFFICIENTS),
            "help": "Newton-Schulz coefficients (megatron-core's names; Megatron-LM HEAD's OptimizerConfig field): "
            "simple (Jordan's constants), quintic, polar_express, aol; ours: polar_express_nanogpt",
        },
    )
    muon_ns_dtype: str = field(
        default="bf16",
        metadata={
            "choices": tuple(NS_DTYPES),
            "flag_default": None,
            "help": "ours: the Newton-Schulz dtype outright; default from --muon-fp32-matmul-prec when given, "
            "else bf16 on CUDA and on CPUs with fast bf16 (AMX/AVX512-BF16), fp32 on other CPUs",
        },
    )
    muon_ns_algorithm: str = field(
        default="auto",
        metadata={
            "choices": NS_ALGORITHMS,
            "help": "ours: standard iterates X (torch.optim.Muon's op order); gram iterates the small Gram "
            "matrix, the same polynomial in fewer flops when one side is > 1.5x the other (less stable in bf16); "
            "auto: gram per matrix in fp32 where it needs fewer flops, standard in bf16 and with "
            "--muon-tp-mode distributed; on a CPU auto and gram compute the symmetric products "
            "(X X^T, the Gram polynomials) by block rows, 0.625 of their multiply-adds",
        },
    )

    def __post_init__(self):
        for flag, value, choices in (
            ("--muon-coefficient-type", self.muon_coefficient_type, tuple(NS_COEFFICIENTS)),
            ("--muon-ns-dtype", self.muon_ns_dtype, tuple(NS_DTYPES)),
            ("--muon-ns-algorithm", self.muon_ns_algorithm, NS_ALGORITHMS),
        ):
            if value not in choices:
                raise ValueError(f"unknown {flag} {value!r}; choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class MuonHyper:
    """What one Muon step reads (megatron-core's OptimizerConfig defaults)."""

    momentum: float = 0.95
    nesterov: bool = False
    ns: NewtonSchulz = NewtonSchulz()
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    tp_mode: str = "blockwise"

    def __post_init__(self):
        for flag, value, choices in (
            ("--muon-scale-mode", self.scale_mode, SCALE_MODES),
            ("--muon-tp-mode", self.tp_mode, TP_MODES),
        ):
            if value not in choices:
                raise ValueError(f"unknown {flag} {value!r}; choose one of {', '.join(choices)}")

    @classmethod
    def of(cls, settings: MuonSettings | None, config) -> MuonHyper:
        """The one place Muon reads megatron-core's OptimizerConfig fields (MatrixMath.hyper), with ``settings``
        (the defaults if None)."""
        s = settings or MuonSettings()
        ns = NewtonSchulz(
            config.muon_num_ns_steps, s.muon_coefficient_type, NS_DTYPES[s.muon_ns_dtype], s.muon_ns_algorithm
        )
        return cls(
            config.muon_momentum,
            config.muon_use_nesterov,
            ns,
            config.muon_scale_mode,
            config.muon_extra_scale_factor,
            config.muon_tp_mode,
        )

    def scale(self, shape: Sequence[int]) -> float:
        return update_scale(tuple(shape[-2:]), self.scale_mode, self.extra_scale_factor)


def hyper_in(config) -> MuonHyper:
    """Muon's step under an optimizer config (its settings from the config's ``rule_settings``)."""
    return MuonHyper.of(RULE.settings_in(config), config)


def splits_qkv(config) -> bool:
    """--muon-split-qkv (megatron-core's muon_split_qkv): Q, K and V orthogonalized apart."""
    return bool(config.muon_split_qkv)


def prepare(grad: Tensor, state: dict[str, Tensor], hyper: MuonHyper) -> Tensor:
    """The momentum, elementwise (MatrixMath.prepare)."""
    return momentum_direction_(grad, state[STATE], hyper.momentum, hyper.nesterov)


def orthogonalized(
    x: Tensor, split_rows, ns: Callable[[Tensor], Tensor], block_scale: Callable[[tuple], float] | None = None
) -> Tensor:
    """``ns`` of a matrix (or a same-shape stack), or of its Q, K and V blocks apart (``split_rows``) merged
    back; with ``block_scale`` each block times the scale of its shape."""
    blocks = split_qkv(x, split_rows) if split_rows else [x]
    out = [ns(b) if block_scale is None else ns(b).mul_(block_scale(tuple(b.shape))) for b in blocks]
    return merge_qkv(out, split_rows, tuple(x.shape)) if split_rows else out[0]


def direction(x: Tensor, state: dict[str, Tensor], hyper: MuonHyper, step: int, split_rows) -> Tensor:
    """The orthogonalized direction (MatrixMath.direction): unscaled for a whole matrix (:func:`scale` folds
    its scale into the lr), each Q, K and V block times its own scale."""
    return orthogonalized(x, split_rows, hyper.ns, hyper.scale if split_rows else None)


def batched(stack: Tensor, states, hyper: MuonHyper, step: int, split_rows) -> Tensor:
    """:func:`direction` of a (B, rows, cols) stack in one batched Newton-Schulz (MatrixMath.batched)."""
    return direction(stack, {}, hyper, step, split_rows)


def sharded(x: Tensor, state, hyper: MuonHyper, step: int, shard: TpShard, split_rows) -> Tensor:
    """--muon-tp-mode distributed (MatrixMath.sharded): the whole matrix's Newton-Schulz with the TP shards
    left in place (newton_schulz.distributed_newton_schulz), each Q, K and V block scaled by its whole shape."""
    block_scale = (lambda shape: hyper.scale(shard.full(shape))) if split_rows else None
    return orthogonalized(x, split_rows, lambda b: hyper.ns.sharded(b, shard.dim, shard.group), block_scale)


def scale(shape: Sequence[int], hyper: MuonHyper, split_rows) -> float:
    """The whole matrix's shape scale, folded into the learning rate; 1 where each Q, K, V block has its own."""
    return hyper.scale(shape) if split_rows is None else 1.0


MATH = MatrixMath(
    direction=direction,
    hyper=MuonHyper.of,
    elementwise=(STATE,),
    prepare=prepare,
    scale=scale,
    batched=batched,
    sharded=sharded,
    qkv=True,
)


@torch.no_grad()
def muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    hyper: MuonHyper,
    *,
    lr: float,
    weight_decay: float,
    split_rows: Sequence[int] | None = None,
) -> None:
    """One Muon step of one matrix, in place on the fp32 master ``param`` and ``momentum_buffer``: the rule's
    own hooks, in ``torch.optim.Muon``'s op order (its single-tensor path)."""
    if param.shape != grad.shape or param.shape != momentum_buffer.shape or param.dim() != 2:
        raise ValueError(
            f"muon_step_ needs equal 2D shapes, got param {tuple(param.shape)}, "
            f"grad {tuple(grad.shape)}, momentum {tuple(momentum_buffer.shape)}"
        )
    step_matrix_(
        MATH, param, grad, {STATE: momentum_buffer}, hyper, 0, lr=lr, weight_decay=weight_decay, split_rows=split_rows
    )


def rule_cost(shape: Sequence[int], split_rows: Sequence[int] | None, context: CostContext) -> int:
    """The planner's cost of a Muon matrix: the multiply-adds of the Newton-Schulz run the optimizer
    config asks for, on the machine that steps (newton_schulz.NewtonSchulzCost)."""
    return newton_schulz_cost(shape, split_rows, hyper_in(context.config).ns.cost(context.on_cpu))


def scalar_rule(config) -> str:
    """The rule of the elementwise parameters: --muon-scalar-optimizer (Megatron-LM HEAD), adam or lion."""
    return {"adam": "adamw"}.get(config.muon_scalar_optimizer, config.muon_scalar_optimizer)


def ns_algorithm_text(config) -> str:
    """--muon-ns-algorithm as it acts in this run (auto_may_use_gram, uses_symmetric)."""
    ns = hyper_in(config).ns
    algorithm = ns.algorithm
    if algorithm == "auto":
        algorithm = "auto: gram where it needs fewer flops" if auto_may_use_gram(ns.dtype) else "auto: standard"
    if ns.algorithm != "standard" and not torch.cuda.is_available():
        algorithm += f", symmetric products by block rows where the short side is >= {SYMMETRIC_MIN_ROWS}"
    return algorithm


def describe(config) -> str:
    """The start-up line's account of Muon's settings."""
    s, h = RULE.settings_in(config), hyper_in(config)
    return (
        f"{s.muon_coefficient_type} x {h.ns.steps} Newton-Schulz steps in {s.muon_ns_dtype} "
        f"({ns_algorithm_text(config)}), TP mode {h.tp_mode}"
    )


def tp_mode(settings: MuonSettings, config) -> str:
    """--muon-tp-mode (megatron-core's muon_tp_mode)."""
    return MuonHyper.of(settings, config).tp_mode


def muon_state_bytes(shape: Sequence[int], context: CostContext) -> int:
    """fp32 momentum, one word per element."""
    return 4 * math.prod(shape)


RULE = matrix_rule(
    NAME,
    MATH,
    settings=MuonSettings,
    cost=rule_cost,
    state_bytes=muon_state_bytes,
    optimizer=NAME,
    elementwise=scalar_rule,
    tp_mode=tp_mode,
    tp_flag="--muon-tp-mode",
    splits_qkv=splits_qkv,
    describe=describe,
)
