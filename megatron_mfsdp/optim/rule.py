"""The contract between the optimizer shell and its update rules.

An update rule is one entry of ``registry.py``: a name, where its parameters are
stored (placement's WHOLE matrix or even SLICE), the state tensors it keeps per
piece, its step function and its planner cost. The shell owns everything else
(fp32 masters, gradient statistics, clipping, loss scaling, state dicts, lr groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class OwnedPiece:
    """One parameter's part in this rank's segment, with its optimizer state. For a
    WHOLE rule the part is the whole matrix (views are 2D); for a SLICE rule a 1D slice."""

    name: str  # its slot's name: the parameter's name in its model chunk (NAME[q] for a Q block placed apart)
    global_name: str  # its name in the unsplit model: unique across virtual and pipeline stages
    rule: str  # update-rule name
    param_numel: int  # elements of the whole (TP-local) parameter
    param_offset: int  # into the flattened parameter
    master: torch.Tensor  # fp32, a view into the master segment
    grad: torch.Tensor  # fp32, a view into the gradient segment
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    split_rows: tuple[int, ...] | None = None  # rows per group of blocks updated apart (QKV)
    partition_dim: int | None = None  # TP split dimension, None if not TP-sharded
    in_grad_norm: bool = True  # False for TP duplicates off TP rank 0, replicas, shared copies

    @property
    def key(self) -> str:
        return f"{self.global_name}@{self.param_offset}"


@dataclass
class StepContext:
    """What a step function may read besides its pieces."""

    config: object  # the MatrixFSDPOptimizerConfig
    step: int  # 1-based count of successful steps, this one included
    lr: float
    weight_decay: float
    tp_group: object | None = None
    dp_group: object | None = None  # the DP shard group (rules that rebuild whole matrices over it)
    matrices: Sequence[GroupMatrix] = ()  # every parameter of this lr group, on all ranks, in step order


@dataclass(frozen=True)
class GroupMatrix:
    """One parameter of an lr group as the whole DP shard group holds it, so that a rule can
    rebuild it from its slices: shard rank r holds elements [bounds[r], bounds[r + 1]) of it."""

    global_name: str
    shape: tuple[int, ...]
    split_rows: tuple[int, ...] | None
    bounds: tuple[int, ...]  # W+1 offsets into the flattened parameter


def zero_cost(shape, split_rows, ns=None) -> int:
    return 0


@dataclass(frozen=True)
class UpdateRule:
    """One optimizer update rule."""

    name: str
    storage: str  # placement.WHOLE or placement.SLICE
    state: tuple[str, ...]  # per-piece state tensors, shaped like the piece, zero-initialized
    step: Callable[[Sequence[OwnedPiece], StepContext], None]
    cost: Callable = zero_cost  # planner cost (shape, split_rows, ns: muon.NewtonSchulzCost) -> int
    optimizer: str | None = None  # the --optimizer value that sends the model's matrices here
    tp_variant: str | None = None  # the rule used instead on tensor-parallel shards (TP > 1)
    check: Callable[[OwnedPiece, object], None] | None = None  # validate a piece at set-up
    even_layout_of: str | None = None  # with --mfsdp-layout even, parameters placed under that WHOLE rule get this one
    collective: bool = False  # the step joins DP collectives: it runs on every rank, pieces or not
