"""megatron-core GPTModel: building it (build), splitting it into units (units), its
parameter roles by name (rules) and global names (naming), and the adapter that hands
all of it to the runtime."""

from __future__ import annotations

import torch

from .build import build_gpt_model, gpt_layer_spec, initialize_by_global_name
from .naming import global_parameter_names
from .roles import gpt_param_roles, qkv_split_rows
from .units import TIED_EMBEDDING, gpt_model_units


class GPTAdapter:
    """The model adapter of megatron-core GPTModel chunks (see models/adapter.py)."""

    def matches(self, module: torch.nn.Module) -> bool:
        from megatron.core.models.gpt import GPTModel

        return isinstance(module, GPTModel)

    units = staticmethod(gpt_model_units)
    param_roles = staticmethod(gpt_param_roles)
    global_names = staticmethod(global_parameter_names)

    def split_rows(self, name: str, config) -> tuple[int, ...] | None:
        """linear_qkv is updated as separate Q, K and V blocks."""
        return qkv_split_rows(config) if name.endswith("linear_qkv.weight") else None


GPT_ADAPTER = GPTAdapter()

__all__ = [
    "GPTAdapter",
    "GPT_ADAPTER",
    "TIED_EMBEDDING",
    "build_gpt_model",
    "gpt_layer_spec",
    "initialize_by_global_name",
    "global_parameter_names",
    "gpt_param_roles",
    "qkv_split_rows",
    "gpt_model_units",
]
