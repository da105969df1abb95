"""Model adapters: everything MatrixFSDP knows about a model lives with the model
(``models/gpt/`` for megatron-core's GPTModel)."""

from __future__ import annotations

import torch

from .adapter import ModelAdapter, ModelUnit


def adapter_for(module: torch.nn.Module) -> ModelAdapter:
    """The adapter of a model chunk; raises naming the type when none fits."""
    from .gpt import GPT_ADAPTER

    for adapter in (GPT_ADAPTER,):
        if adapter.matches(module):
            return adapter
    raise TypeError(
        f"MatrixFSDP has no model adapter for {type(module).__name__} (supported: megatron-core GPTModel chunks)"
    )


__all__ = ["ModelAdapter", "ModelUnit", "adapter_for"]
