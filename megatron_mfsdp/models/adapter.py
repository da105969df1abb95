"""What the runtime needs to know of a model, in one small interface.

A model adapter tells how a model chunk splits into units (the pieces gathered and
released together), which role its parameters play (a hidden matrix, or elementwise), which
matrices are updated as several blocks (QKV), and each parameter's global name
(its name in the unsplit 1 x 1 x 1 model, the key of optimizer state and checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class ModelUnit:
    """A unit of a model: its parameters, and the modules around whose forward it must be
    materialized (acquired before the first, released after the last)."""

    name: str
    params: list[tuple[str, torch.nn.Parameter]]
    modules: list[torch.nn.Module]
    extra_sites: list[torch.nn.Module] = field(default_factory=list)  # e.g. a tied output layer
    shared_across_stages: bool = False  # held by two pipeline stages: gradients summed between them


class ModelAdapter(Protocol):
    def matches(self, module: torch.nn.Module) -> bool: ...

    def units(self, module: torch.nn.Module) -> list[ModelUnit]: ...

    def param_roles(self) -> list[tuple[str, str]]: ...

    def split_rows(self, name: str, config) -> tuple[int, ...] | None: ...

    def global_names(self, module: torch.nn.Module) -> dict[str, str]: ...
