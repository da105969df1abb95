"""Which update rule each parameter gets, and so how it is stored.

A rule list maps fnmatch patterns on parameter names to update-rule names; the
first match wins. The names a model uses come from its adapter
(``models/gpt/rules.py``), user rules (``--mfsdp-param-rule``) go first. Placement
only needs two facts of each update rule, given by the optimizer's registry: its
*storage* (the whole matrix on one owner, or any even slice of the flat tail) and
its planner *cost*.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

WHOLE = "whole"
"""Storage of a rule that needs each matrix whole (Muon): one owner holds all of it."""

SLICE = "slice"
"""Storage of an elementwise rule (AdamW): any even slice of the flat buffer will do."""

LAYOUTS = ("owner", "even")
"""--mfsdp-layout: 'owner' stores WHOLE rules' matrices whole on one owner; 'even' stores every
parameter as an even slice (ordinary ZeRO-3), each WHOLE rule replaced by its even variant."""

Rule = tuple[str, str]  # (fnmatch pattern on the parameter name, update-rule name)
CostFn = Callable[[tuple[int, ...], Sequence[int] | None], int]


@dataclass(frozen=True)
class RuleKind:
    """What placement needs to know of one update rule."""

    storage: str  # WHOLE or SLICE
    cost: CostFn  # planner cost of one parameter (shape, split rows or None)


@dataclass(frozen=True)
class RuleSet:
    """An ordered rule list plus the storage and cost of each rule it names."""

    rules: tuple[Rule, ...]
    kinds: Mapping[str, RuleKind]

    def classify(self, name: str, shape: Sequence[int]) -> str:
        """The update rule of one parameter; raise if no rule matches or a non-matrix
        would be stored whole."""
        for pattern, rule in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                if rule not in self.kinds:
                    raise ValueError(
                        f"rule {pattern!r}={rule!r}: unknown update rule {rule!r} "
                        f"(--mfsdp-param-rule); choose one of {', '.join(sorted(self.kinds))}"
                    )
                if self.kinds[rule].storage == WHOLE and len(shape) != 2:
                    raise ValueError(
                        f"parameter {name!r} of shape {tuple(shape)} matches rule {pattern!r}={rule!r}, "
                        f"but {rule} needs a 2D matrix; add --mfsdp-param-rule '{name}=adamw'"
                    )
                return rule
        raise ValueError(
            f"parameter {name!r} of shape {tuple(shape)} fits no placement rule; "
            f"add --mfsdp-param-rule '{name}=muon' or '{name}=adamw'"
        )

    def storage(self, rule: str) -> str:
        return self.kinds[rule].storage

    def cost(self, rule: str, shape: tuple[int, ...], split_rows: Sequence[int] | None = None) -> int:
        return self.kinds[rule].cost(shape, split_rows)


def parse_rule(text: str, known: Sequence[str]) -> Rule:
    """``PATTERN=RULE`` (the --mfsdp-param-rule syntax) -> (pattern, rule)."""
    pattern, _, rule = text.rpartition("=")
    if not pattern or rule not in known:
        raise ValueError(f"--mfsdp-param-rule {text!r}: expected PATTERN=RULE with RULE one of {', '.join(known)}")
    return pattern, rule
