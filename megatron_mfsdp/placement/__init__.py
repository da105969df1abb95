"""Placement: which update rule each parameter gets (rules; a model's units classified and
costed in specs), who owns each whole matrix (planner), where every element lives in its
unit's flat buffer (layout), and the checks that all ranks agree (verify). Nothing here
imports a model."""

from .classes import SLICE, WHOLE, RuleKind, RuleSet, parse_rule
from .layout import LocalPiece, ParamSlot, ParamSpec, Plan, UnitLayout, UnitSpec, balance
from .planner import POLICIES, RankLoads, plan_units
from .specs import unit_specs
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
    "RankLoads",
    "unit_specs",
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
