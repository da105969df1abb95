"""megatron-mfsdp: owner-sharded ZeRO-3 (MatrixFSDP) with communication-free Muon for
megatron-core.

    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, MatrixFSDPOptimizerConfig, get_megatron_optimizer
    from megatron_mfsdp.optim import registry

    opt_config = MatrixFSDPOptimizerConfig(optimizer="muon", lr=3e-3)      # or soap, shampoo, adam, ...
    rules = registry.rule_set((), opt_config)                               # optim/registry.py
    model = MatrixFSDP(transformer_config, MatrixFSDPConfig(rules=rules), gpt_model)   # like megatron's DDP
    optimizer = get_megatron_optimizer(opt_config, [model])
    print(model.plan.report())                                              # who owns what

``pretrain_gpt.py`` is the training entry point.
"""

__version__ = "0.1.0"

# First: importing it imports megatron.core with its fusions compiled at their first call, not at
# import (compat/jit.py: seconds per process).
from .compat import jit as _jit  # noqa: F401
from .config import MatrixFSDPConfig, MatrixFSDPOptimizerConfig
from .groups import ProcessGroups
from .optim.optimizer import MatrixFSDPOptimizer, get_megatron_optimizer
from .placement.layout import Plan
from .runtime.pipeline import configure_schedule, forward_backward
from .runtime.wrapper import MatrixFSDP

__all__ = [
    "MatrixFSDP",
    "MatrixFSDPConfig",
    "MatrixFSDPOptimizerConfig",
    "MatrixFSDPOptimizer",
    "Plan",
    "ProcessGroups",
    "configure_schedule",
    "forward_backward",
    "get_megatron_optimizer",
    "__version__",
]
