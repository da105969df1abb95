"""Which placement class each parameter gets, and so how it is stored.

A rule list maps fnmatch patterns on parameter names to a class: a *role* the model's adapter
gives (``models/gpt/roles.py``: a hidden matrix, or an elementwise parameter: norms, biases,
embeddings, the output layer), or an update rule a user names (``--mfsdp-param-rule``, tried
first); the first match wins. Placement only needs three facts of each class, given by the
optimizer's registry for the rule that will run on it: its *storage* (the whole matrix on one
owner, or any even slice of the flat tail), its planner *cost* (multiply-adds per step) and its
resident *state bytes*, and whether Q, K and V are updated apart.
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

MATRIX = "matrix"
"""Role of a model's hidden matrices (attention and MLP weights): --optimizer's matrix rule runs on them."""

ELEMENTWISE = "elementwise"
"""Role of everything else (norms, biases, embeddings, the output layer): an elementwise rule runs on them."""

ROLES = (MATRIX, ELEMENTWISE)

Rule = tuple[str, str]  # (fnmatch pattern on the parameter name, role or update-rule name)
CostFn = Callable[[tuple[int, ...], Sequence[int] | None], int]


def no_state(shape) -> int:
    return 0


@dataclass(frozen=True)
class RuleKind:
    """What placement needs to know of one class (a role, or a named update rule)."""

    storage: str  # WHOLE or SLICE
    cost: CostFn  # planner cost of one parameter (shape, split rows or None): multiply-adds per step
    state_bytes: Callable[[tuple[int, ...]], int] = no_state  # resident optimizer state of one parameter
    splits_qkv: bool = False  # Q, K and V are updated apart (each a block of the cost, and may be placed apart)
    rule: str = ""  # the update rule that steps this class (the optimizer's registry resolved it once)


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
        named = ", ".join(sorted(set(self.kinds) - set(ROLES)))
        raise ValueError(
            f"parameter {name!r} of shape {tuple(shape)} fits no placement rule; "
            f"add --mfsdp-param-rule '{name}=RULE' naming an update rule ({named})"
        )

    def storage(self, rule: str) -> str:
        return self.kinds[rule].storage

    def cost(self, rule: str, shape: tuple[int, ...], split_rows: Sequence[int] | None = None) -> int:
        return self.kinds[rule].cost(shape, split_rows)

    def state_bytes(self, rule: str, shape: tuple[int, ...]) -> int:
        return self.kinds[rule].state_bytes(shape)

    def splits_qkv(self, rule: str) -> bool:
        return self.kinds[rule].splits_qkv

    def update_rule(self, placed: str) -> str:
        """The name of the update rule that steps parameters placed under ``placed`` (a role or a rule name)."""
        return self.kinds[placed].rule

    def extended(self, rules: Sequence[Rule]) -> RuleSet:
        """This set with ``rules`` (a model's roles) tried after its own (the user's)."""
        return RuleSet(tuple(self.rules) + tuple(rules), self.kinds)


def parse_rule(text: str, known: Sequence[str]) -> Rule:
    """``PATTERN=RULE`` (the --mfsdp-param-rule syntax) -> (pattern, rule)."""
    pattern, _, rule = text.rpartition("=")
    if not pattern or rule not in known:
        raise ValueError(f"--mfsdp-param-rule {text!r}: expected PATTERN=RULE with RULE one of {', '.join(known)}")
    return pattern, rule
