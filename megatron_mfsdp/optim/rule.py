"""The contract between the optimizer shell and its update rules.

An update rule is one file and one entry of ``registry.py``: a name, where its parameters are
stored (placement's WHOLE matrix or even SLICE), its own settings (a dataclass whose fields are
its flags), the state it keeps per piece and how it starts, its step, and its planner cost
(multiply-adds per step and resident state bytes). The shell owns everything else: fp32 masters,
gradient statistics, clipping, loss scaling, state dicts, lr groups. The recipe is in
CONTRIBUTING.md.
"""

from __future__ import annotations

import math
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
    tp_size: int = 1  # size of the TP group the piece is split over (1 when not TP-sharded)
    tp_rank: int = 0
    tp_group: object | None = None  # the group it is split over (dense TP, or expert TP for an expert)
    state_over_tp: bool = False  # its rule keeps state of the whole TP-split matrix, alike on every TP rank
    param_shape: tuple[int, ...] = ()  # the parameter's (TP-local) shape; a slice's master is 1D
    state_replica: int = 0  # >0 where another rank saves the same whole-matrix state (an even layout's copies)
    runs: tuple[int, int, int, int] | None = None  # (first, run, stride, count): its elements of the flat parameter

    @property
    def key(self) -> str:
        return f"{self.global_name}@{self.param_offset}"

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole matrix across TP (the piece's own shape when it is not TP-split)."""
        shape = list(self.master.shape)
        if self.partition_dim is not None and len(shape) == 2:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)


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
    settings: object | None = None  # the rule's own settings (its dataclass, from its flags), if it has any


@dataclass(frozen=True)
class GroupMatrix:
    """One parameter of an lr group as the whole DP shard group holds it, so that a rule can
    rebuild it from its slices: shard rank r holds elements [bounds[r], bounds[r + 1]) of it."""

    global_name: str
    shape: tuple[int, ...]
    split_rows: tuple[int, ...] | None
    bounds: tuple[int, ...]  # W+1 offsets into the flattened parameter


@dataclass(frozen=True)
class CostContext:
    """What a planner cost may read: the optimizer config (a rule's settings in it: UpdateRule.settings_in)
    and where the step runs (a CPU picks other Newton-Schulz kernels than a GPU)."""

    config: object
    on_cpu: bool = False


def zero_cost(shape, split_rows, context: CostContext) -> int:
    return 0


def never(config) -> bool:
    return False


@dataclass(frozen=True)
class UpdateRule:
    """One optimizer update rule."""

    name: str
    storage: str  # placement.WHOLE or placement.SLICE
    state: tuple[str, ...] | Callable[[OwnedPiece, object], dict[str, torch.Tensor]]
    """Per-piece state: names of zero tensors shaped like the piece, or ``init(piece, settings)`` returning
    tensors of any shape (factors, eigenbases, scalars)."""
    step: Callable[[Sequence[OwnedPiece], StepContext], None]
    cost: Callable = zero_cost  # planner multiply-adds per step: (shape, split_rows, CostContext) -> int
    state_bytes: Callable[[tuple[int, ...], CostContext], int] | None = None
    """Resident state bytes of one matrix of this shape (the planner balances them); None: 4 per element and
    state name."""
    settings: type | None = None  # the rule's own settings: a dataclass whose fields are its flags
    optimizer: str | None = None  # the --optimizer value that sends the model's matrices here
    elementwise: Callable[[object], str] | str | None = None
    """With this rule as --optimizer's matrix rule, the rule of the elementwise parameters (norms, biases,
    embeddings): a name, or a function of the optimizer config (--muon-scalar-optimizer)."""
    reshard: tuple[str, ...] | None = None
    """State tensors that are elementwise in the parameter's own basis, so a checkpoint splits them like
    the parameter (any TP, DP or PP layout reads them); the others are saved whole under their matrix's
    name. None: every state named in ``state``."""
    splits_qkv: Callable[[object], bool] = never  # whether QKV's Q, K and V blocks are updated apart
    check: Callable[[OwnedPiece, object], None] | None = None  # validate a piece at set-up
    collective: bool = False  # the step joins DP collectives: it runs on every rank, pieces or not
    state_over_tp: Callable[[object], bool] = never
    """Whether, under this optimizer config, the rule keeps the state of the whole TP-split matrix on every
    TP rank (an exact TP mode), rather than of its TP-local shard."""
    even: UpdateRule | None = None  # its --mfsdp-layout even variant, registered with it (matrix.py)
    family: str | None = None  # the rule whose settings this variant shares (an even or TP variant's)
    describe: Callable[[object], str] | None = None
    """Its settings under an optimizer config, for the start-up line; None: its settings' fields."""
    validate: Callable[[object], None] | None = None
    """Raise, naming the flag, if an optimizer config holds settings this rule cannot step with."""

    def settings_in(self, config):
        """This rule's settings in an optimizer config (its ``rule_settings``, by the name of the rule whose
        settings a variant shares), the defaults where absent; None for a rule without settings."""
        if self.settings is None:
            return None
        return getattr(config, "rule_settings", {}).get(self.family or self.name) or self.settings()

    def init_state(self, piece: OwnedPiece, settings) -> dict[str, torch.Tensor]:
        if callable(self.state):
            return self.state(piece, settings)
        return {name: torch.zeros_like(piece.master) for name in self.state}

    def resharded(self, name: str) -> bool:
        """Whether state ``name`` is split like the parameter in checkpoints (else saved whole)."""
        if self.reshard is not None:
            return name in self.reshard
        return not callable(self.state) and name in self.state

    def resident_bytes(self, shape: tuple[int, ...], context: CostContext) -> int:
        if self.state_bytes is not None:
            return self.state_bytes(shape, context)
        return 4 * math.prod(shape) * (0 if callable(self.state) else len(self.state))
