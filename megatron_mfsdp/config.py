"""Configuration of MatrixFSDP: the runtime (a DDP-like config) and the optimizer.

megatron-core's ``OptimizerConfig`` already carries the Muon knobs
(``muon_momentum``, ``muon_split_qkv``, ``muon_scale_mode`` ...). We subclass it
rather than keep a parallel set, change two defaults to the ones the Muon
literature uses (Nesterov on, extra scale 0.2 so the update RMS matches AdamW)
and add only what megatron-core has no field for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from megatron.core.optimizer import OptimizerConfig

PLANNER_POLICIES = ("greedy", "global", "auto")
NS_DTYPES = ("bf16", "fp32")


@dataclass
class MatrixFSDPConfig:
    """Runtime configuration of the owner-sharded ZeRO-3 wrapper (the analogue
    of megatron-core's ``DistributedDataParallelConfig``)."""

    param_rules: List[Tuple[str, str]] = field(default_factory=list)
    """User rules ``(fnmatch pattern on the parameter name, 'muon' | 'adamw')``, tried
    before the built-in rules; the first match wins."""

    planner: str = "auto"
    """Owner planner policy: 'greedy' (per unit, largest first, load carried across
    units), 'global' (largest first over the whole model) or 'auto' (the better of the
    two by max/mean balance)."""

    muon_split_qkv: bool = True
    """Cost QKV matrices as separate Q, K, V blocks (as the optimizer orthogonalizes them)."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32 (else in the parameter dtype); the owner accumulates in fp32."""

    prefetch: bool = True
    """Start gathering the next unit's weights while the current unit computes."""

    verify_collectives: bool = True
    """Before every owner collective, all-gather a 3-integer signature and raise on a
    mismatch instead of hanging. Costs one tiny collective per unit operation."""

    def __post_init__(self):
        if self.planner not in PLANNER_POLICIES:
            raise ValueError(
                f"unknown planner policy {self.planner!r} (--mfsdp-planner); "
                f"choose one of {', '.join(PLANNER_POLICIES)}"
            )
        for rule in self.param_rules:
            if len(rule) != 2 or rule[1] not in ("muon", "adamw"):
                raise ValueError(
                    f"bad parameter rule {rule!r} (--mfsdp-param-rule): "
                    "expected PATTERN=muon or PATTERN=adamw"
                )


@dataclass
class MatrixFSDPOptimizerConfig(OptimizerConfig):
    """megatron-core's ``OptimizerConfig`` plus the Muon fields it lacks."""

    optimizer: str = "muon"
    """'muon': Muon on owned matrices and AdamW on the tail; 'adam': AdamW everywhere."""

    muon_use_nesterov: bool = True
    """Nesterov momentum for Muon (megatron-core's default is False; Muon's is True)."""

    muon_extra_scale_factor: float = 0.2
    """Extra factor on the Muon update scale; 0.2 with 'spectral' matches AdamW's update RMS."""

    muon_coefficients: str = "jordan"
    """Newton-Schulz coefficients: 'jordan' (3.4445, -4.7750, 2.0315) each step, or 'quintic'
    (a per-step schedule)."""

    muon_ns_dtype: str = "bf16"
    """dtype of the Newton-Schulz iterations: 'bf16' (the GPU default) or 'fp32'."""

    def __post_init__(self):
        super().__post_init__()
        if self.optimizer not in ("muon", "adam"):
            raise ValueError(f"unknown optimizer {self.optimizer!r} (--optimizer); choose muon or adam")
        if self.muon_ns_dtype not in NS_DTYPES:
            raise ValueError(
                f"unknown Newton-Schulz dtype {self.muon_ns_dtype!r} (--muon-ns-dtype); "
                f"choose one of {', '.join(NS_DTYPES)}"
            )
        # Imported here: muon.py is the optimizer math and has no config dependency.
        from .muon import SCALE_MODES, ns_coefficients_for

        if self.muon_scale_mode not in SCALE_MODES:
            raise ValueError(
                f"unknown Muon scale mode {self.muon_scale_mode!r} (--muon-scale-mode); "
                f"choose one of {', '.join(SCALE_MODES)}"
            )
        ns_coefficients_for(self.muon_coefficients, self.muon_num_ns_steps)
        from .tp_muon import TP_MODES

        if self.muon_tp_mode not in TP_MODES:
            raise ValueError(f"unknown Muon TP mode {self.muon_tp_mode!r} (--muon-tp-mode); "
                             f"choose one of {', '.join(TP_MODES)}")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"--muon-ns-steps must be >= 1, got {self.muon_num_ns_steps}")
