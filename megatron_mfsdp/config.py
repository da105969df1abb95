"""Configuration of MatrixFSDP: the runtime (a DDP-like config) and the optimizer.

megatron-core's ``OptimizerConfig`` already carries the Muon knobs (``muon_momentum``,
``muon_split_qkv``, ``muon_scale_mode`` ...). We subclass it rather than keep a
parallel set and add only what megatron-core has no field for: the optimizer name's
wider choices, ``muon_scalar_optimizer`` (Megatron-LM HEAD's field) and each update
rule's own settings (``rule_settings``: a dataclass per rule, Muon's Newton-Schulz
run among them, optim/muon.py ``MuonSettings``). Every field with a fixed set of
values names it in ``metadata["choices"]``: the command line takes its choices and
defaults from these dataclasses (one source of truth).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.optimizer import OptimizerConfig

from .optim import registry
from .optim.muon import MuonSettings
from .placement.blocks import MODES as QKV_OWNER_MODES
from .placement.classes import LAYOUTS, MATRIX, RuleSet
from .placement.collective_cost import MODES as COLLECTIVE_MODES
from .placement.planner import POLICIES
from .precision.fp8 import Fp8Config
from .runtime.comm import REDUCE_ORDERS


def _check_choice(value, choices, flag: str, what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r} ({flag}); choose one of {', '.join(map(str, choices))}")


@dataclass
class MatrixFSDPConfig:
    """Runtime configuration of the owner-sharded ZeRO-3 wrapper (the analogue of
    megatron-core's ``DistributedDataParallelConfig``)."""

    param_rules: list[tuple[str, str]] = field(default_factory=list)
    """User rules ``(fnmatch pattern on the parameter name, update-rule name)``, tried before
    the model's own rules; the first match wins."""

    planner: str = field(default="auto", metadata={"choices": POLICIES})
    """Owner planner policy: 'greedy' (per unit, largest first, load carried across units),
    'global' (largest first over the whole model) or 'auto' (the better of the two)."""

    layout: str = field(default="owner", metadata={"choices": LAYOUTS})
    """'owner': each Muon matrix whole on one DP owner (communication-free step); 'even': ordinary
    ZeRO-3 even flat shards with reconstruction Muon (gathers each matrix per step: the baseline)."""

    split_qkv_owners: str = field(default="whole", metadata={"choices": QKV_OWNER_MODES})
    """'whole': a linear_qkv weight's Q, K and V on one owner; 'contiguous': each on an owner of its
    own where a TP shard holds one query group (so each is one row range); 'all': also where query
    groups interleave them (placement/blocks.py). Needs the QKV split (the blocks are updated apart
    anyway) and the owner layout, without FP8."""

    rules: RuleSet | None = None
    """The update rules resolved for the optimizer config (``optim.registry.rule_set``): each role's and
    rule's storage, planner cost and state bytes, whether Q, K and V are updated apart and the rule that
    steps it, with the user's rules (``param_rules``) in it. None: Muon's with its defaults, the placement
    a MatrixFSDP made without an optimizer config gets. pretrain_gpt.py builds it from the optimizer
    config; another value changes only the plan's balance, never the numbers (the optimizer steps by the
    rule set of its own config)."""

    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32 (else in the parameter dtype); the owner accumulates in fp32."""

    prefetch: bool = True
    """Start gathering the next units' weights while the current unit computes."""

    prefetch_depth: int = 1
    """How many units ahead (forward) or behind (backward) to gather while a unit computes."""

    overlap_grad_reduce: bool = False
    """Launch a unit's gradient reduction asynchronously when its gradients are ready and wait for it only
    when needed (a bounded number in flight, all landed by finish_grad_sync); the sums are the same."""

    max_reduces_in_flight: int = 2
    """With overlap_grad_reduce: reductions started but not yet waited for, at most."""

    reduce_order: str = field(default="auto", metadata={"choices": REDUCE_ORDERS})
    """How each owner's gradient is summed over the DP shard group. 'rank': a chain in rank order,
    bitwise the single-process reference (fp32 partial sums; an owner in the middle of the chain also
    receives its parts' sums); 'ring': NCCL's reduce per owner part and reduce-scatter of the tail,
    summed in ring order in the wire dtype; 'auto': ring on NCCL, rank elsewhere (gloo). Each moves
    about one unit per rank and reduction, however the owners split it."""

    collectives: str = field(default="auto", metadata={"choices": COLLECTIVE_MODES})
    """Each unit's owner-collective algorithm, gather and reduction apart (placement/collectives.py):
    'auto' the fastest by the cost model (a reduction in rank order stays the exact chain); 'parts',
    'two-level' or 'padded' forces one everywhere (tests, benchmarks). The sums' order is the
    algorithm's; the elements moved and where they land are the same."""

    verify_collectives: bool = True
    """Before every owner collective, MAX all-reduce a 3-integer signature and its negative and raise on a
    mismatch instead of hanging. Costs one tiny collective per unit operation."""

    fp8: Fp8Config | None = None
    """FP8 parameters (--fp8-format with --fp8-param-gather): owners quantize their whole matrices
    after each step and the gather moves e4m3 bytes plus fp32 scale-inverses; None keeps the dtype."""

    fp8_bf16_layers: tuple[int, int] = (0, 0)
    """Transformer layers kept in the parameter dtype at the start and at the end
    (--first-last-layers-bf16 with --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16)."""

    def __post_init__(self):
        if self.fp8 is not None and self.fp8.fp8_recipe == "delayed" and any(self.fp8_bf16_layers):
            raise ValueError("--fp8-recipe delayed does not support --first-last-layers-bf16 (as Megatron-LM)")
        _check_choice(self.planner, POLICIES, "--mfsdp-planner", "planner policy")
        if self.prefetch_depth < 0:
            raise ValueError(f"prefetch depth {self.prefetch_depth} (--mfsdp-prefetch-depth) must be 0 or more")
        if self.max_reduces_in_flight < 1:
            raise ValueError(f"max_reduces_in_flight must be at least 1, got {self.max_reduces_in_flight}")
        _check_choice(self.layout, LAYOUTS, "--mfsdp-layout", "layout")
        _check_choice(self.reduce_order, REDUCE_ORDERS, "--mfsdp-reduce-order", "reduce order")
        _check_choice(self.collectives, COLLECTIVE_MODES, "--mfsdp-collectives", "owner collectives")
        _check_choice(self.split_qkv_owners, QKV_OWNER_MODES, "--mfsdp-split-qkv-owners", "Q/K/V owner mode")
        for rule in self.param_rules:
            if len(rule) != 2 or rule[1] not in registry.rule_names():
                raise ValueError(
                    f"bad parameter rule {rule!r} (--mfsdp-param-rule): expected PATTERN=RULE "
                    f"with RULE one of {', '.join(registry.rule_names())}"
                )
        if self.rules is None:
            self.rules = registry.rule_set(self.param_rules, MatrixFSDPOptimizerConfig(optimizer="muon"), self.layout)
        if self.split_qkv_owners != "whole":
            flag = f"--mfsdp-split-qkv-owners {self.split_qkv_owners}"
            if not self.rules.splits_qkv(MATRIX):
                raise ValueError(
                    f"{flag} places Q, K and V apart, which the matrix rule updates whole "
                    "(--muon-no-split-qkv orthogonalizes them together)"
                )
            if self.layout != "owner":
                raise ValueError(f"{flag} needs --mfsdp-layout owner (even shards have no owners)")
            if self.fp8 is not None:
                raise ValueError(f"{flag} does not support --fp8-param-gather (FP8 scales are per whole weight)")


@dataclass
class MatrixFSDPOptimizerConfig(OptimizerConfig):
    """megatron-core's ``OptimizerConfig`` (its defaults) plus the fields it lacks."""

    optimizer: str = "adam"
    """The rule of the model's hidden matrices (optim/registry.py): 'adam' (AdamW) or 'sgd' everywhere, or
    a matrix optimizer ('muon', ...) on the matrices with an elementwise rule on the rest."""

    muon_scalar_optimizer: str = field(default="adam", metadata={"choices": ("adam", "lion")})
    """The rule of the elementwise parameters (norms, biases, embeddings) with --optimizer muon or
    adaptive_muon (Megatron-LM HEAD's OptimizerConfig field)."""

    rule_settings: dict = field(default_factory=dict)
    """Each rule's own settings (its dataclass, filled from its flags), by rule name; defaults for the rest."""

    def __post_init__(self):
        super().__post_init__()
        _check_choice(self.optimizer, registry.optimizer_choices(), "--optimizer", "optimizer")
        _check_choice(self.muon_scalar_optimizer, ("adam", "lion"), "--muon-scalar-optimizer", "scalar optimizer")
        self.rule_settings = {**registry.settings_defaults(), **self.rule_settings}
        registry.validate(self)


def muon_rule_set(ns, split_qkv: bool = True, rules=(), layout: str = "owner") -> RuleSet:
    """:func:`registry.rule_set` for Muon with the Newton-Schulz run ``ns`` (a newton_schulz.NewtonSchulzCost):
    what the planner benchmarks and the scaling model plan with."""
    config = MatrixFSDPOptimizerConfig(
        optimizer="muon",
        muon_num_ns_steps=ns.steps,
        muon_split_qkv=split_qkv,
        rule_settings={"muon": MuonSettings(muon_ns_dtype=ns.dtype, muon_ns_algorithm=ns.algorithm)},
    )
    return registry.rule_set(rules, config, layout, ns.on_cpu)
