"""Model units -> planner specs: each parameter's placement class, storage, cost and state bytes.

The wrapper, tools/plan.py and the benchmarks plan from the same specs, so this lives with the
planner rather than in the runtime. Placement never imports a model: ``units`` and ``adapter``
are duck-typed (models/adapter.py's ``ModelUnit`` and ``ModelAdapter``)."""

from __future__ import annotations

from .blocks import split_qkv_blocks
from .layout import ParamSpec, UnitSpec


def unit_specs(units: list, ddp_config, adapter, config) -> list[UnitSpec]:
    """Classify and cost the parameters of model units for the planner: user rules first, then the
    model's roles (``ddp_config.rules``: each one's storage, cost and state bytes, from the optimizer's
    registry); Q, K and V split where the matrix rule updates them apart, and with ``split_qkv_owners``
    placed as items of their own."""
    rules = ddp_config.rules.extended(adapter.param_roles())
    specs = []
    for unit in units:
        params = []
        for name, p in unit.params:
            rule, shape = rules.classify(name, p.shape), tuple(p.shape)
            split = adapter.split_rows(name, config) if rules.splits_qkv(rule) else None
            spec = ParamSpec(name, shape, rule, rules.storage(rule), rules.cost(rule, shape, split), split)
            spec.state_bytes = rules.state_bytes(rule, shape)
            params.append(spec)
        specs.append(UnitSpec(unit.name, params))
    return split_qkv_blocks(specs, ddp_config.split_qkv_owners, rules.cost, rules.state_bytes)
