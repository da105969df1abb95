"""The update rules, one entry each. Adding an optimizer is one file that defines a
``RULE`` (see rule.py and CONTRIBUTING.md) plus its entry in ``_ENTRIES``.

The optimizer shell, placement and the command line read everything from here. A model tags
its parameters by role (placement/classes.py: MATRIX, ELEMENTWISE); ``--optimizer`` names the
rule of the matrices (the rule that declares ``optimizer=``), and that rule names the rule of
the elementwise parameters (its ``elementwise``; an elementwise optimizer runs on both).
``--mfsdp-param-rule`` names rules directly. Placement takes each rule's storage, cost and state
bytes (:func:`rule_set`); the command line takes ``--optimizer``'s choices and each rule's
settings (its flags) from here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ..placement.classes import ELEMENTWISE, LAYOUTS, MATRIX, ROLES, SLICE, WHOLE, RuleKind, RuleSet
from . import adamw, adaptive_muon, lion, muon, muon_even, muon_tp, sgd, shampoo, soap
from .rule import CostContext, UpdateRule

_ENTRIES: tuple[UpdateRule, ...] = (
    muon.RULE,
    muon_tp.RULE,
    adamw.RULE,
    sgd.RULE,
    muon_even.RULE,
    shampoo.RULE,
    adaptive_muon.RULE,
    lion.RULE,
    soap.RULE,
)
RULES: dict[str, UpdateRule] = {}


def register(rule: UpdateRule) -> None:
    """Add a rule (and its even variant) from outside the package, a plug-in's or a test's: the same as
    an entry in ``_ENTRIES``, for this process. A name already taken is refused."""
    global _ENTRIES
    for r in (rule,) + ((rule.even,) if rule.even is not None else ()):
        if r.name in RULES:
            raise ValueError(f"update rule {r.name!r} is already registered")
        RULES[r.name] = r
    if not any(r is rule for r in _ENTRIES):
        _ENTRIES = _ENTRIES + (rule,)


for _rule in _ENTRIES:
    register(_rule)


def get(name: str) -> UpdateRule:
    if name not in RULES:
        raise ValueError(f"unknown update rule {name!r}; choose one of {', '.join(RULES)}")
    return RULES[name]


def order(name: str) -> int:
    """Registration order: the order of the optimizer's param groups."""
    return list(RULES).index(name)


def optimizer_choices() -> list[str]:
    """Values of --optimizer: rules that declare the optimizer name they stand for."""
    return [rule.optimizer for rule in _ENTRIES if rule.optimizer]


def rule_names() -> list[str]:
    """Rules a user may name in --mfsdp-param-rule."""
    return list(RULES)


def optimizer_rule(optimizer: str) -> UpdateRule:
    """The rule --optimizer OPTIMIZER runs on the model's matrices."""
    for rule in _ENTRIES:
        if rule.optimizer == optimizer:
            return rule
    raise ValueError(f"unknown optimizer {optimizer!r} (--optimizer); choose one of {', '.join(optimizer_choices())}")


def elementwise_rule(config) -> UpdateRule:
    """The rule of the elementwise parameters under ``config.optimizer``: that rule itself when it is
    elementwise, else the one it names (e.g. --muon-scalar-optimizer)."""
    main = optimizer_rule(config.optimizer)
    if main.storage == SLICE:
        return main
    named = main.elementwise(config) if callable(main.elementwise) else main.elementwise
    return get(named or adamw.RULE.name)


def rule_for(placed: str, storage: str, config) -> UpdateRule:
    """The update rule of a piece placed under ``placed`` (a role or a rule name) as ``storage`` when
    training with ``config``: a role takes --optimizer's rule for it; a WHOLE rule on an even slice
    (--mfsdp-layout even) takes its even variant."""
    if placed == MATRIX:
        rule = optimizer_rule(config.optimizer)
    elif placed == ELEMENTWISE:
        rule = elementwise_rule(config)
    else:
        rule = get(placed)
    return get(even_variant(rule.name)) if storage == SLICE and rule.storage == WHOLE else rule


def even_variant(name: str) -> str:
    """The rule that stands for ``name`` under --mfsdp-layout even: SLICE rules stay, a WHOLE rule
    is replaced by the rule that declares ``even_layout_of=name``."""
    if get(name).storage != WHOLE:
        return name
    if get(name).even is not None:
        return get(name).even.name
    for rule in _ENTRIES:
        if rule.even_layout_of == name:
            return rule.name
    raise ValueError(
        f"update rule {name!r} has no even-shard variant: --mfsdp-layout even (ZeRO-3 with reconstruction) "
        f"cannot place it; use --mfsdp-layout owner"
    )


def settings_defaults() -> dict[str, object]:
    """Each rule's settings with their defaults (the rules that have settings)."""
    return {rule.name: rule.settings() for rule in _ENTRIES if rule.settings is not None}


def settings_of(rule: UpdateRule, config):
    """The rule's settings in ``config`` (a MatrixFSDPOptimizerConfig), its defaults if absent."""
    if rule.family is not None:
        rule = get(rule.family)
    if rule.settings is None:
        return None
    return getattr(config, "rule_settings", {}).get(rule.name) or rule.settings()


def describe(config) -> str:
    """The rules ``config`` runs and their settings, for the start-up line."""

    def account(rule: UpdateRule) -> str:
        if rule.describe is not None:
            return rule.describe(config)
        settings = settings_of(rule, config)
        if settings is None:
            return "Megatron's optimizer flags"
        return ", ".join(f"{f.name} {getattr(settings, f.name)}" for f in dataclasses.fields(settings))

    main, elementwise = optimizer_rule(config.optimizer), elementwise_rule(config)
    text = f"{main.name} ({account(main)})"
    return text if elementwise is main else f"{text} on matrices, {elementwise.name} on the rest"


def setting_dest(rule: UpdateRule, field: str) -> str:
    """The parsed-flags attribute of a rule's setting: the field's name, prefixed with the rule's name
    unless it already is (``soap_shampoo_beta`` stays; each matrix rule's ``tp_mode`` is ``soap_tp_mode``...)."""
    return field if field.startswith(rule.name + "_") else f"{rule.name}_{field}"


def settings_from_args(args) -> dict[str, object]:
    """Each rule's settings from parsed flags (:func:`setting_dest` of each field)."""
    out = {}
    for rule in _ENTRIES:
        if rule.settings is not None:
            values = {f.name: getattr(args, setting_dest(rule, f.name)) for f in dataclasses.fields(rule.settings)}
            out[rule.name] = rule.settings(**{k: v for k, v in values.items()})
    return out


def _kind(rule: UpdateRule, storage: str, config, context: CostContext) -> RuleKind:
    return RuleKind(
        storage,
        functools.partial(_cost, rule, context),
        functools.partial(rule.resident_bytes, context=context),
        bool(rule.splits_qkv(config)),
    )


def _cost(rule: UpdateRule, context: CostContext, shape, split_rows=None) -> int:
    return rule.cost(shape, split_rows, context)


def rule_set(
    rules: Sequence[tuple[str, str]] = (), config=None, layout: str = "owner", on_cpu: bool = False
) -> RuleSet:
    """Placement's view of a user rule list (``(pattern, rule name)``) for training with ``config`` (a
    MatrixFSDPOptimizerConfig; None: Muon with its defaults, the placement MatrixFSDP makes without one):
    every role's and rule's storage, planner cost and state bytes. With layout 'even' every WHOLE rule is
    replaced by its even variant, so every parameter is an even SLICE. A model's roles are appended by
    the runtime (``RuleSet.extended``)."""
    if config is None:
        from ..config import MatrixFSDPOptimizerConfig

        config = MatrixFSDPOptimizerConfig(optimizer=muon.RULE.optimizer)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (--mfsdp-layout); choose one of {', '.join(LAYOUTS)}")
    context, named = CostContext(config, on_cpu), {name for _, name in rules}
    kinds = {}
    for placed in ROLES + tuple(RULES):
        rule = rule_for(placed, WHOLE, config)
        if placed == MATRIX and rule.storage != WHOLE:
            rule = muon.RULE  # hidden matrices stay whole (planned as Muon's) whatever the optimizer, as before
        storage = SLICE if layout == "even" else rule.storage
        try:
            kinds[placed] = _kind(rule_for(rule.name, storage, config), storage, config, context)
        except ValueError:  # a WHOLE rule with no even variant: refused if this run would place anything under it
            if placed == MATRIX or placed in named:
                raise
    return RuleSet(tuple(rules), kinds)


def muon_rule_set(ns, split_qkv: bool = True, rules: Sequence[tuple[str, str]] = (), layout: str = "owner") -> RuleSet:
    """:func:`rule_set` for Muon with the Newton-Schulz run ``ns`` (a muon.NewtonSchulzCost): what the planner
    benchmarks and the scaling model plan with."""
    from ..config import MatrixFSDPOptimizerConfig

    config = MatrixFSDPOptimizerConfig(
        optimizer=muon.RULE.optimizer,
        muon_num_ns_steps=ns.steps,
        muon_ns_dtype=ns.dtype,
        muon_ns_algorithm=ns.algorithm,
        muon_split_qkv=split_qkv,
    )
    return rule_set(rules, config, layout, ns.on_cpu)
