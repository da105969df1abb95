"""pretrain_gpt.py's command line: Megatron-LM's flags with Megatron-LM's names, defaults and
meaning (model_flags.py, run_flags.py), megatron-core's Muon names and ours (ours.py), every other
Megatron-LM flag accepted with a notice or refused with its reason (accepted.py, refused.py), the
help of each flag in Megatron-LM's groups (flag_help.py), and the checks that run before any process
group, model or dataset exists (validate.py)."""

from __future__ import annotations

import argparse

from . import accepted, flag_help, model_flags, ours, run_flags


def build_parser() -> argparse.ArgumentParser:
    """The flags pretrain_gpt.py implements (Megatron-LM's and ours), each with its help, in
    Megatron-LM's argument groups. ``full_parser`` adds the noticed and refused ones."""
    from ...optim import registry

    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [flags] (Megatron-LM's; see --help)",
        allow_abbrev=False,
        description="Pretrain a megatron-core GPT. Megatron-LM's flags, plus --use-matrix-fsdp (owner-sharded "
        "ZeRO-3 with communication-free Muon) and --mfsdp-*. Without data flags it trains on a corpus built "
        "from this machine's Python sources (scripts/quickstart.sh shows a complete command).",
        epilog="Every other flag of Megatron-LM's parser is refused before any work, naming the feature "
        "megatron-mfsdp lacks (context parallelism, multi-latent attention, ...); an unknown flag gets the closest "
        "known names.",
    )
    model_flags.add_network_size_args(p)
    model_flags.add_initialization_args(p)
    model_flags.add_fusion_args(p)
    model_flags.add_mixed_precision_args(p)
    model_flags.add_regularization_args(p)
    model_flags.add_moe_args(p)
    run_flags.add_training_args(p, registry.optimizer_choices())
    run_flags.add_learning_rate_args(p)
    run_flags.add_checkpointing_args(p)
    run_flags.add_distributed_args(p)
    run_flags.add_validation_args(p)
    run_flags.add_data_args(p)
    run_flags.add_logging_args(p)
    ours.add_muon_args(p)
    before = len(p._action_groups)
    ours.add_rule_args(p)
    rule_groups = p._action_groups[before:]
    ours.add_mfsdp_args(p)
    flag_help.fill_help(p)
    flag_help.regroup(p, keep=rule_groups)
    p.rule_groups = rule_groups
    return p


def full_parser() -> argparse.ArgumentParser:
    """build_parser with every other Megatron-LM flag registered (noticed ones shown in --help in their
    Megatron-LM group, refused ones hidden); what parse_args parses with."""
    p = build_parser()
    accepted.add_accepted_args(p)
    flag_help.fill_help(p)
    flag_help.regroup(p, keep=p.rule_groups)
    return p


def given_flags(argv, parser) -> list:
    """The option strings this command line gave, in its order (notices and errors follow it)."""
    known = parser._option_string_actions
    flags = [token.split("=", 1)[0] for token in argv if token.startswith("--")]
    return list(dict.fromkeys(f for f in flags if f in known))


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to $WORLD_SIZE (torchrun) or 1. Every error
    exits 2 naming its flag, before anything starts."""
    import os
    import sys

    from . import moe, validate

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = full_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(accepted.explain_unrecognized(extra, parser))
    args.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    args.explicit = given_flags(argv, parser)
    args.notices = list(getattr(args, "deprecations", []))
    try:
        args.notices += accepted.check_accepted(args, args.explicit)
        for check in (
            validate.validate_parallel,
            validate.validate_model,
            validate.validate_precision,
            validate.validate_schedule,
            validate.validate_device,
            moe.validate_moe,
            validate.validate_optimizer,
            validate.validate_data,
            validate.validate_io,
        ):
            check(args)
    except ValueError as err:
        parser.error(str(err))
    return args
