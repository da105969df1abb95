"""The update rules, one entry each. Adding an optimizer is one file that defines a
``RULE`` (see rule.py and CONTRIBUTING.md) plus its entry in ``_ENTRIES``.

The optimizer shell, placement and the command line read everything from here:
the shell loops over rules by name, placement takes each rule's storage and cost,
``--optimizer`` and ``--mfsdp-param-rule`` take their choices from the names.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..placement.rules import LAYOUTS, SLICE, WHOLE, RuleKind, RuleSet
from . import adamw, muon, muon_even, muon_tp, sgd
from .rule import UpdateRule

_ENTRIES: tuple[UpdateRule, ...] = (muon.RULE, muon_tp.RULE, adamw.RULE, sgd.RULE, muon_even.RULE)
RULES: dict[str, UpdateRule] = {rule.name: rule for rule in _ENTRIES}


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


PLACEMENT_MATRIX_RULE = "muon"
"""Placement stores the model's hidden matrices under this rule (whole, on one owner) whatever
the optimizer, so a layout and its checkpoints do not depend on --optimizer."""


def matrix_rule(optimizer: str) -> str:
    """The rule that --optimizer OPTIMIZER applies to the model's hidden matrices."""
    for rule in _ENTRIES:
        if rule.optimizer == optimizer:
            return rule.name
    raise ValueError(f"unknown optimizer {optimizer!r} (--optimizer); choose one of {', '.join(optimizer_choices())}")


def resolve(slot_rule: str, optimizer: str) -> UpdateRule:
    """The update rule of a piece placed under ``slot_rule`` when training with ``optimizer``: an
    elementwise optimizer (adam, sgd) runs everywhere; a matrix optimizer (muon) keeps placement's
    rules (muon on the hidden matrices, adamw on the rest, and the user's --mfsdp-param-rule)."""
    main = get(matrix_rule(optimizer))
    return main if main.storage == SLICE else get(slot_rule)


def even_variant(name: str) -> str:
    """The rule that stands for ``name`` under --mfsdp-layout even: SLICE rules stay, a WHOLE rule
    is replaced by the rule that declares ``even_layout_of=name``."""
    if get(name).storage != WHOLE:
        return name
    for rule in _ENTRIES:
        if rule.even_layout_of == name:
            return rule.name
    raise ValueError(f"update rule {name!r} has no even-shard variant; --mfsdp-layout even cannot place it")


def rule_set(
    rules: Sequence[tuple[str, str]], layout: str = "owner", ns: muon.NewtonSchulzCost | None = None
) -> RuleSet:
    """Placement's view of a rule list: each named rule's storage and cost (Muon's by the
    Newton-Schulz run ``ns``, the default settings if None). With layout 'even' every WHOLE
    rule is replaced by its even variant, so every parameter is an even SLICE."""
    ns = ns or muon.NewtonSchulzCost()
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (--mfsdp-layout); choose one of {', '.join(LAYOUTS)}")
    if layout == "even":
        rules = [(pattern, even_variant(name) if name in RULES else name) for pattern, name in rules]
    kinds = {name: RuleKind(rule.storage, functools.partial(rule.cost, ns=ns)) for name, rule in RULES.items()}
    return RuleSet(tuple(rules), kinds)
