"""Muon flags as megatron-core names them (Megatron-LM's defaults), and the flags that are
ours: MatrixFSDP placement and what megatron has no name for. Choices come from the update
rule registry and the config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses

from .types import finite_float, nonnegative_int, positive_int, probability


def _field(cls, name: str):
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def config_default(cls, name: str):
    """Our flags' defaults come from the config dataclasses (one source of truth)."""
    return _field(cls, name).default


def config_choices(cls, name: str) -> list:
    return list(_field(cls, name).metadata["choices"])


def add_config_choice(g, flag: str, cls, name: str, help: str) -> None:
    """A flag whose choices and default are a config field's (one source of truth)."""
    g.add_argument(flag, choices=config_choices(cls, name), default=config_default(cls, name), help=help)


class _Deprecated(argparse.Action):
    """An old spelling, kept for one release: sets the new dest and records a notice."""

    def __init__(self, option_strings, dest, new_flag: str, value_map=None, const=None, **kwargs):
        self.new_flag, self.value_map = new_flag, value_map or {}
        super().__init__(option_strings, dest, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else self.value_map.get(values, values)
        setattr(namespace, self.dest, value)
        namespace.deprecations = getattr(namespace, "deprecations", []) + [
            f"{option_string} is deprecated and will be removed in the next release: {self.new_flag}"
        ]


def add_muon_args(p: argparse.ArgumentParser) -> None:
    """megatron-core's Muon flags: its OptimizerConfig muon_* fields (core_v0.16.1 names; --muon-nesterov
    from HEAD). Muon's own settings (--muon-coefficient-type, --muon-ns-dtype, --muon-ns-algorithm) are a
    rule's flags (add_rule_args, optim/muon.py MuonSettings)."""
    from ...config import MatrixFSDPOptimizerConfig as O
    from ...optim.matrix import TP_MODES
    from ...optim.muon import SCALE_MODES

    g = p.add_argument_group("Muon (megatron-core's names and Megatron-LM's defaults)")
    g.add_argument("--muon-momentum", type=probability, default=0.9)
    g.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false")
    g.add_argument("--muon-use-nesterov", "--muon-nesterov", dest="muon_use_nesterov", action="store_true")
    g.add_argument("--muon-scale-mode", default="spectral", choices=list(SCALE_MODES))
    g.add_argument(
        "--muon-fp32-matmul-prec",
        default="medium",
        choices=["low", "medium", "high"],
        help="Newton-Schulz precision: medium/low iterate in bf16, high in fp32 (see --muon-ns-dtype)",
    )
    g.add_argument("--muon-num-ns-steps", type=positive_int, default=5)
    g.add_argument(
        "--muon-tp-mode",
        default="blockwise",
        choices=list(TP_MODES),
        help="blockwise: Newton-Schulz per TP shard, no communication (depends on the TP size); "
        "distributed: Gram matrices all-reduced over TP (exact); duplicated: all-gather (exact)",
    )
    g.add_argument("--muon-extra-scale-factor", type=finite_float, default=1.0)
    g.add_argument(
        "--muon-scalar-optimizer",
        default=config_default(O, "muon_scalar_optimizer"),
        choices=config_choices(O, "muon_scalar_optimizer"),
        help="the rule of the elementwise parameters (embeddings, biases, norms) with --optimizer muon or "
        "adaptive_muon (Megatron-LM HEAD): adam (AdamW) or lion",
    )
    _add_deprecated_muon_args(g)


def add_rule_args(p: argparse.ArgumentParser) -> None:
    """Each update rule's own settings (optim/registry.py), a flag per field of its settings dataclass: its
    name (Megatron-LM's OptimizerConfig field where one exists) with dashes, or the field's ``flag``; the
    default and help from the field. A new rule's flags need nothing here."""
    from ...optim import registry

    for rule in registry.settings_rules():
        # Ours, titled so (Megatron-LM's own flags among them, e.g. --lion-beta1, move to its groups: flag_help.regroup)
        g = p.add_argument_group(f"MatrixFSDP: {rule.name} ({(rule.settings.__doc__ or '').strip().splitlines()[0]})")
        for f in dataclasses.fields(rule.settings):
            _add_setting(g, f, registry.setting_dest(rule, f.name))


def _add_setting(g, f, dest: str) -> None:
    flag, meta = f.metadata.get("flag", "--" + dest.replace("_", "-")), f.metadata
    kwargs = dict(dest=dest, default=meta.get("flag_default", f.default), help=meta.get("help"))
    if isinstance(f.default, bool):
        g.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    elif "choices" in meta:
        g.add_argument(flag, choices=list(meta["choices"]), **kwargs)
    else:
        kind = meta.get("type") or {float: finite_float, int: positive_int}.get(type(f.default), str)
        g.add_argument(flag, type=kind, **kwargs)


def _add_deprecated_muon_args(g) -> None:
    g.add_argument(
        "--no-muon-nesterov",
        dest="muon_use_nesterov",
        action=_Deprecated,
        nargs=0,
        const=False,
        new_flag="drop it (Nesterov is off unless --muon-use-nesterov is given)",
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--muon-ns-steps",
        dest="muon_num_ns_steps",
        action=_Deprecated,
        type=positive_int,
        new_flag="use --muon-num-ns-steps",
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--muon-coefficients",
        dest="muon_coefficient_type",
        action=_Deprecated,
        value_map={"jordan": "simple", "quintic": "polar_express_nanogpt"},
        new_flag="use --muon-coefficient-type (jordan is simple; our old quintic is polar_express_nanogpt)",
        default=argparse.SUPPRESS,  # the dest is Muon's setting (add_rule_args): its flag sets the default
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--muon-split-qkv",
        dest="muon_split_qkv",
        action=_Deprecated,
        nargs=0,
        const=True,
        new_flag="drop it (QKV is split unless --muon-no-split-qkv is given)",
        help=argparse.SUPPRESS,
    )


def _add_placement_args(g) -> None:
    """Where parameters live: the planner, the layout, Q/K/V blocks, hybrid replicas, rule overrides."""
    from ...config import MatrixFSDPConfig as R
    from ...optim import registry

    g.add_argument("--mfsdp-planner", choices=config_choices(R, "planner"), default=config_default(R, "planner"))
    add_config_choice(
        g,
        "--mfsdp-layout",
        R,
        "layout",
        "owner: each Muon matrix whole on one DP rank, the optimizer step moves no tensor data; "
        "even: ordinary ZeRO-3 even flat shards with reconstruction Muon (each matrix gathered over DP "
        "and orthogonalized on every rank each step), the baseline owner placement is measured against",
    )
    add_config_choice(
        g,
        "--mfsdp-split-qkv-owners",
        R,
        "split_qkv_owners",
        "give the Q, K and V blocks of each linear_qkv owners of their own (finer items for the planner; "
        "the weight is merged after each gather). contiguous: where a TP shard holds one query group; all: "
        "also where groups interleave them (MHA). Needs Muon with the QKV split, the owner layout and no FP8",
    )
    g.add_argument(
        "--mfsdp-replicate-size",
        type=positive_int,
        default=1,
        help="hybrid sharding: owners within groups of DP/R ranks, R replicas across them; at EP above 1 the "
        "expert-DP group gets gcd(R, expert DP) replicas",
    )
    g.add_argument(
        "--mfsdp-ranks-per-node",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks per node (a node is N consecutive global ranks), for owner collectives in two levels: "
        "inside each node, then across nodes on rails. Must spread each DP shard group evenly over the nodes; "
        "default: the launcher's (LOCAL_WORLD_SIZE), else every rank on one node",
    )
    g.add_argument(
        "--mfsdp-param-rule",
        action="append",
        default=[],
        metavar="PATTERN=RULE",
        help="put parameters whose name matches PATTERN (fnmatch) under update rule RULE "
        f"({', '.join(registry.rule_names())})",
    )


def add_mfsdp_args(p: argparse.ArgumentParser) -> None:
    from ...config import MatrixFSDPConfig as R
    from .flag_help import OURS

    g = p.add_argument_group(OURS)
    g.add_argument(
        "--use-matrix-fsdp",
        action="store_true",
        help="owner-sharded ZeRO-3: each 2D weight whole on one DP owner. Without it, megatron-core's "
        "DistributedDataParallel (and DistributedOptimizer with --use-distributed-optimizer) runs",
    )
    _add_placement_args(g)
    g.add_argument(
        "--mfsdp-prefetch-depth",
        type=nonnegative_int,
        default=config_default(R, "prefetch_depth"),
        metavar="N",
        help="gather the next N units' weights (forward) or previous N (backward) while a unit computes; "
        "0: gather each unit when it is needed. Each costs one unit's weights of transient memory",
    )
    add_config_choice(
        g,
        "--mfsdp-reduce-order",
        R,
        "reduce_order",
        "how each owner's gradient is summed over DP. rank: a chain in rank order, bitwise the "
        "single-process reference (fp32 partial sums); ring: NCCL's reduce per owner part and reduce-scatter "
        "of the tail, summed in ring order in the wire dtype; auto: ring on NCCL, rank elsewhere (gloo). "
        "Either moves about one unit per rank and reduction, however the owners split it",
    )
    add_config_choice(
        g,
        "--mfsdp-collectives",
        R,
        "collectives",
        "each unit's owner gather and reduction: parts (a broadcast or reduce per owner part and an "
        "all-gather or reduce-scatter of the tail), two-level (per part over the owner's inter-node rail "
        "group, then inside each node), padded (one all-gather or reduce-scatter of the segments padded "
        "to the largest: more bytes, one latency). auto: the fastest by a latency-bandwidth model, per "
        "unit and direction, printed in the plan table; a reduction in rank order (--mfsdp-reduce-order) "
        "stays the exact chain. A forced algorithm applies to both directions",
    )
    g.add_argument(
        "--mfsdp-no-verify-collectives",
        dest="mfsdp_verify_collectives",
        action="store_false",
        default=config_default(R, "verify_collectives"),
        help="skip the per-collective signature check",
    )
    g.add_argument(
        "--mfsdp-vocab-padding-independent-of-tp",
        action="store_true",
        help="pad the vocabulary by --make-vocab-size-divisible-by alone (a multiple of the TP size), not "
        "times the TP size: the same padded vocabulary, and so the same numbers, at every TP size",
    )
    g.add_argument("--output-dir", default=None, help="ours: loss_history.json and loss_curve.png go here")
