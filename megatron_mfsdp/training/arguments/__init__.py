"""pretrain_gpt.py's command line: Megatron-LM's flags with Megatron-LM's names, defaults and
meaning (model_flags.py, run_flags.py), megatron-core's Muon names and ours (ours.py), flags
accepted where they do not apply here or refused clearly (accepted.py), and the checks that
run before any process group, model or dataset exists (validate.py)."""

from __future__ import annotations

import argparse

from . import model_flags, ours, run_flags


def build_parser() -> argparse.ArgumentParser:
    from ...optim import registry

    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="%(prog)s [flags] (Megatron-LM's; see --help)",
        allow_abbrev=False,
        description="Pretrain a megatron-core GPT. Megatron-LM's flags, plus --use-matrix-fsdp (owner-sharded "
        "ZeRO-3 with communication-free Muon) and --mfsdp-*. Without data flags it trains on a corpus built "
        "from this machine's Python sources (scripts/quickstart.sh shows a complete command).",
    )
    model_flags.add_network_size_args(p)
    model_flags.add_initialization_args(p)
    model_flags.add_fusion_args(p)
    model_flags.add_mixed_precision_args(p)
    model_flags.add_regularization_args(p)
    run_flags.add_training_args(p, registry.optimizer_choices())
    run_flags.add_learning_rate_args(p)
    run_flags.add_checkpointing_args(p)
    run_flags.add_distributed_args(p)
    run_flags.add_validation_args(p)
    run_flags.add_data_args(p)
    run_flags.add_logging_args(p)
    ours.add_muon_args(p)
    ours.add_rule_args(p)
    ours.add_mfsdp_args(p)
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

    from . import accepted, validate

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    accepted.add_accepted_args(parser)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(accepted.explain_unrecognized(extra))
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
            validate.validate_optimizer,
            validate.validate_data,
            validate.validate_io,
        ):
            check(args)
    except ValueError as err:
        parser.error(str(err))
    return args
