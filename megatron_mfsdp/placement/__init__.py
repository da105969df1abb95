"""Placement: which update rule each parameter gets (rules), who owns each whole
matrix (planner), where every element lives in its unit's flat buffer (layout), and
the checks that all ranks agree (verify). Nothing here imports a model."""

from .classes import SLICE, WHOLE, RuleKind, RuleSet, parse_rule
from .layout import LocalPiece, ParamSlot, ParamSpec, Plan, UnitLayout, UnitSpec, balance
from .planner import POLICIES, plan_units
from .verify import GATHER, REDUCE, check_signature, verify_plan_agreement

__all__ = [
    "LocalPiece",
    "ParamSlot",
    "ParamSpec",
    "Plan",
    "UnitLayout",
    "UnitSpec",
    "balance",
    "POLICIES",
    "plan_units",
    "SLICE",
    "WHOLE",
    "RuleKind",
    "RuleSet",
    "parse_rule",
    "GATHER",
    "REDUCE",
    "check_signature",
    "verify_plan_agreement",
]
