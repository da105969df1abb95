"""The update rules, one entry each. Adding an optimizer is one file that defines a
``RULE`` (see rule.py and CONTRIBUTING.md) plus its entry in ``_ENTRIES``.

The optimizer shell, placement and the command line read everything from here. A model tags
its parameters by role (placement/classes.py: MATRIX, ELEMENTWISE); ``--optimizer`` names the
rule of the matrices (the rule that declares ``optimizer=``), and that rule names the rule of
the elementwise parameters (its ``elementwise``; an elementwise optimizer runs on both).
``--mfsdp-param-rule`` names rules directly. :func:`rule_set` resolves every role and rule name
once, for an optimizer config and a layout, into the RuleSet that placement (storage, cost, state
bytes) and the optimizer shell (which rule steps each class) both read; the command line takes
``--optimizer``'s choices and each rule's settings (its flags) from here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ..placement.classes import ELEMENTWISE, LAYOUTS, MATRIX, ROLES, SLICE, WHOLE, RuleKind, RuleSet
from . import adamw, adaptive_muon, lion, muon, sgd, shampoo, soap
from .rule import CostContext, UpdateRule

_ENTRIES: tuple[UpdateRule, ...] = (
    muon.RULE,
    adamw.RULE,
    sgd.RULE,
    muon.RULE.even,
    shampoo.RULE,
    shampoo.RULE.even,
    adaptive_muon.RULE,
    adaptive_muon.RULE.even,
    lion.RULE,
    soap.RULE,
    soap.RULE.even,
)
"""Every rule and --mfsdp-layout even variant, in the order of the optimizer's param groups (the order the
gradient statistics sum the pieces in; kept as it was when muon_tp and muon_even were rules of their own)."""
RULES: dict[str, UpdateRule] = {}
RENAMED = {"muon_tp": "muon"}
"""Rule names a checkpoint may hold that are another rule's today (Muon's TP modes were a rule of their own)."""


def _add(rule: UpdateRule) -> None:
    if rule.name in RULES:
        raise ValueError(f"update rule {rule.name!r} is already registered")
    RULES[rule.name] = rule


def register(rule: UpdateRule) -> None:
    """Add a rule (and its even variant) from outside the package, a plug-in's or a test's: the same as
    an entry in ``_ENTRIES``, for this process. A name already taken is refused."""
    global _ENTRIES
    for r in (rule,) + ((rule.even,) if rule.even is not None else ()):
        _add(r)
        if not any(e is r for e in _ENTRIES):
            _ENTRIES = _ENTRIES + (r,)


for _rule in _ENTRIES:
    _add(_rule)


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


def settings_rules() -> list[UpdateRule]:
    """The rules that own settings (a dataclass whose fields are flags); variants share their rule's."""
    return [rule for rule in _ENTRIES if rule.settings is not None and rule.family is None]


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
    if storage != SLICE or rule.storage != WHOLE:
        return rule
    if rule.even is None:
        raise ValueError(
            f"update rule {rule.name!r} has no even-shard variant: --mfsdp-layout even (ZeRO-3 with reconstruction) "
            f"cannot place it; use --mfsdp-layout owner"
        )
    return rule.even


def validate(config) -> None:
    """Raise, naming the flag, where a rule ``config`` runs (--optimizer's and its elementwise rule) has a
    setting it cannot step with."""
    for rule in {optimizer_rule(config.optimizer), elementwise_rule(config)}:
        if rule.validate is not None:
            rule.validate(config)


def settings_defaults() -> dict[str, object]:
    """Each rule's settings with their defaults (the rules that have settings)."""
    return {rule.name: rule.settings() for rule in settings_rules()}


def describe(config) -> str:
    """The rules ``config`` runs and their settings, for the start-up line."""

    def account(rule: UpdateRule) -> str:
        if rule.describe is not None:
            return rule.describe(config)
        settings = rule.settings_in(config)
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


def _kind(placed: str, layout: str, config, context: CostContext) -> RuleKind:
    """What placement needs of one class, and the rule that steps it: the hidden matrices stay whole and are
    planned as Muon's whatever the --optimizer (an elementwise one steps them as it would a slice)."""
    runs = rule_for(placed, WHOLE, config)
    planned = muon.RULE if placed == MATRIX and runs.storage != WHOLE else runs
    storage = SLICE if layout == "even" else planned.storage
    runs, planned = rule_for(runs.name, storage, config), rule_for(planned.name, storage, config)
    return RuleKind(
        storage,
        functools.partial(_cost, planned, context),
        functools.partial(planned.resident_bytes, context=context),
        bool(planned.splits_qkv(config)),
        runs.name,
    )


def _cost(rule: UpdateRule, context: CostContext, shape, split_rows=None) -> int:
    return rule.cost(shape, split_rows, context)


def rule_set(rules: Sequence[tuple[str, str]], config, layout: str = "owner", on_cpu: bool = False) -> RuleSet:
    """Every role and rule name resolved once for training with ``config`` (a MatrixFSDPOptimizerConfig) in
    ``layout``: its storage, planner cost and state bytes (placement's), whether Q, K and V are updated apart,
    and the update rule that steps it (the optimizer's). ``rules`` are the user's (``(pattern, rule name)``);
    a model's roles are appended by the runtime (``RuleSet.extended``). With layout 'even' every WHOLE rule is
    replaced by its even variant, so every parameter is an even SLICE."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (--mfsdp-layout); choose one of {', '.join(LAYOUTS)}")
    context, named, kinds = CostContext(config, on_cpu), {name for _, name in rules}, {}
    for placed in ROLES + tuple(RULES):
        try:
            kinds[placed] = _kind(placed, layout, config, context)
        except ValueError:  # a WHOLE rule with no even variant: refused if this run would place anything under it
            if placed == MATRIX or placed in named:
                raise
    return RuleSet(tuple(rules), kinds)
