"""The typed configs the layers below training/ take, each built here from the parsed pretrain_gpt.py
namespace by one function (megatron-core's rule: ``args`` stays in megatron/training;
megatron/training/arguments.py core_transformer_config_from_args is the model's)."""

from __future__ import annotations

import dataclasses


def transformer_config_from_args(args):
    """megatron-core's TransformerConfig of the run: every argument named as one of its fields, then the
    ones Megatron-LM derives (models/gpt/config.py transformer_config)."""
    from ..models.gpt.config import transformer_config

    return transformer_config(vars(args))


def gpt_model_kwargs_from_args(args) -> dict:
    """GPTModel's own keyword arguments of the run (models/gpt/config.py gpt_model_kwargs)."""
    from ..models.gpt.config import gpt_model_kwargs

    return gpt_model_kwargs(vars(args))


def fp8_config_from_args(args):
    """The run's Fp8Config (precision/fp8.py) from the flags of its field names; None when
    --fp8-format is not given."""
    from ..precision import Fp8Config

    if getattr(args, "fp8", None) is None:
        return None
    return Fp8Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Fp8Config) if hasattr(args, f.name)})


def checkpoint_settings_from_args(args, **overrides):
    """The run's CheckpointSettings (checkpoint/settings.py): the checkpoint flags of its field names,
    and the arguments as the checkpoint stores them (checkpoint/state.py args_dict, taken now, so a
    save records the arguments as they are at that save). ``overrides`` replace fields (the
    --pretrained-checkpoint load)."""
    from ..checkpoint.settings import CheckpointSettings
    from ..checkpoint.state import args_dict

    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(CheckpointSettings)
        if f.name != "run_args" and hasattr(args, f.name)
    }
    flags = ("async_save", "no_save_optim", "no_save_rng", "log_progress", "finetune", "no_load_optim", "no_load_rng")
    values.update({name: bool(values[name]) for name in flags if name in values})  # store_true flags default to None
    return CheckpointSettings(**{**values, "run_args": args_dict(args), **overrides})
