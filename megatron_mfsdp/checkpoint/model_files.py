"""Model weights in Megatron-LM's ``--ckpt-format torch_dist`` layout, read and written whole.

The layout (megatron/training/checkpointing.py at core_v0.16.1): ``DIR/latest_checkpointed_iteration.txt``
names the iteration, ``DIR/iter_%07d/`` is a megatron-core ``dist_checkpointing.save`` of a state dict
whose ``"model"`` entry is ``GPTModel.sharded_state_dict(prefix="")`` and whose common (non-tensor) part
holds ``"args"`` (a plain dict of JSON-able values, ``vars(args)``), ``"checkpoint_version"`` 3.0 and
``"iteration"``; our ``manifest.json`` (files.py, integrity.py) checksums every file. Sharded-tensor keys are global
(layers stacked on a leading axis, TP splits as offsets), so what any TP x PP x DP layout saved is read
here by one process at 1 x 1 x 1 (dist_checkpointing reshards), and what is written here loads at any
layout.

Tensors are exchanged under the names of the whole model's ``state_dict()`` (``models/gpt/hf.py``).
``load_model_shard`` reads one TP shard of the same checkpoint for decoding (models/gpt/generate.py).
"""

from __future__ import annotations

import json
import os
import tempfile
from argparse import Namespace

import torch
import torch.distributed as dist

from ..compat.cpu import cuda_on_cpu
from . import dist as torch_dist
from . import files
from .state import CHECKPOINT_VERSION

EXTRA_STATE = "._extra_state"

# Settings of the run, not of the model: the whole model is built on one rank without them.
WHOLE_MODEL_OVERRIDES = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "sequence_parallel": False,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "use_cpu_initialization": True,
    "perform_initialization": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "recompute_granularity": None,
    "recompute_method": None,
    "recompute_num_layers": None,
}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read as a model checkpoint; the message names the file."""


def ensure_process_group() -> bool:
    """dist_checkpointing runs on a process group: torchrun's, or a one-rank gloo group made here.
    Returns whether this call made it."""
    if dist.is_initialized():
        return False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo")
    else:
        init_file = tempfile.NamedTemporaryFile(prefix="mfsdp_pg_", delete=False).name
        os.unlink(init_file)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    return True


def plain_args(stored) -> dict:
    """A checkpoint's ``args`` entry (a Namespace, as Megatron-LM saves it, or a dict) as a dict;
    refuses values JSON cannot hold."""
    values = dict(vars(stored) if isinstance(stored, Namespace) else stored)
    for key, value in values.items():
        try:
            json.dumps(value)
        except TypeError:
            raise CheckpointError(f"args[{key!r}] = {value!r} is not a JSON value") from None
    return values


def _stored_model(stored: dict, tp: int) -> torch.nn.Module:
    """megatron-core's GPTModel of a checkpoint's stored args at TP = ``tp`` x PP = 1 (model parallel
    state already set up), from the local layer spec in the stored dtype, weights left uninitialized."""
    from ..models.gpt import build_gpt_model
    from ..models.gpt.config import gpt_model_kwargs, transformer_config
    from ..models.gpt.hf import MEGATRON_DEFAULTS

    built = {**MEGATRON_DEFAULTS, **stored, **WHOLE_MODEL_OVERRIDES, "tensor_model_parallel_size": tp}
    return build_gpt_model(
        transformer_config(built),
        vocab_size=built["padded_vocab_size"],
        max_sequence_length=built["max_position_embeddings"],
        use_transformer_engine=False,
        **gpt_model_kwargs(built),
    )


def whole_model(stored: dict) -> torch.nn.Module:
    """megatron-core's GPTModel of a checkpoint's stored args at 1 x 1 x 1 on this rank (every rank
    is a DP rank), from the local layer spec in the stored dtype, weights left uninitialized."""
    from ..groups import initialize_model_parallel

    if not stored.get("padded_vocab_size"):
        raise CheckpointError("args lacks padded_vocab_size: the embedding size is unknown")
    initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    return _stored_model(stored, 1)


def model_tensors(model: torch.nn.Module) -> dict:
    """The whole model's weights by state-dict name (megatron's empty ``_extra_state`` left out)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith(EXTRA_STATE)}


def checkpoint_folder(root: str, step: int | None = None) -> tuple[str, int]:
    """(iteration folder, iteration) of --load ROOT (the tracker's, or ``step``: --ckpt-step),
    its files checked against our manifest first (a Megatron-LM save has none: a notice); collective
    over the process group (a one-rank one is made if none exists)."""
    target = files.load_target(root, step)
    if target is None:
        raise CheckpointError(
            f"{os.path.join(root, files.TRACKER)}: no such file (not a --ckpt-format torch_dist checkpoint folder)"
        )
    folder = target[0]
    if not os.path.isfile(os.path.join(folder, "metadata.json")):
        raise CheckpointError(f"{folder}: no metadata.json (missing or not written by dist_checkpointing)")
    ensure_process_group()
    try:  # each rank its share of the files (collective), not every rank all of them
        files.verify_collective(folder, foreign_ok=True)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    return target


def load_whole_model(root: str, step: int | None = None) -> tuple[dict, torch.nn.Module]:
    """(stored args, GPTModel at 1 x 1 x 1 holding the weights) of a torch_dist checkpoint saved at any
    layout; collective over the process group (every rank receives the whole model)."""
    from megatron.core import dist_checkpointing

    folder, _ = checkpoint_folder(root, step)
    ensure_process_group()
    common = dist_checkpointing.load_common_state_dict(folder)
    if "args" not in common:
        raise CheckpointError(f"{folder}/common.pt: no 'args' (the model settings travel there)")
    stored = dict(vars(common["args"]) if isinstance(common["args"], Namespace) else common["args"])
    model = whole_model(stored)
    sharded = {k: v for k, v in model.sharded_state_dict(prefix="").items() if not k.endswith(EXTRA_STATE)}
    with cuda_on_cpu():
        loaded = dist_checkpointing.load({"model": sharded}, folder)
    model.load_state_dict(loaded["model"], strict=False)
    return stored, model


def read_model_checkpoint(root: str, step: int | None = None) -> tuple[dict, dict]:
    """(stored args, {state-dict name: tensor}) of a torch_dist checkpoint saved at any layout (collective)."""
    stored, model = load_whole_model(root, step)
    return stored, model_tensors(model)


def write_model_checkpoint(root: str, stored, tensors: dict, iteration: int = 0) -> str:
    """Write the whole model as a torch_dist checkpoint at 1 x 1 x 1 (any layout loads it) with no
    optimizer state (resume it with --finetune or --no-load-optim, as a converted Megatron-LM
    checkpoint): into a temporary folder, checksummed, renamed into place, then the tracker
    (files.py). Collective over the process group. Returns the iteration folder. ``stored``: the
    model's Megatron-LM args (a dict or Namespace), saved as the checkpoint's ``args`` entry."""
    from ..models.gpt.hf import load_into_model

    stored = plain_args(stored)
    ensure_process_group()
    model = whole_model(stored)
    load_into_model(model, tensors)
    folder = files.iteration_dir(root, iteration)
    if os.path.exists(folder) and os.listdir(folder):
        raise CheckpointError(f"{folder}: already exists; choose an empty --save-dir")
    tmp = files.temporary_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        files.remove_leftovers(root)
        os.makedirs(tmp)
    dist.barrier()
    state = {
        "model": model.sharded_state_dict(prefix=""),
        "args": stored,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
    }
    entries = torch_dist.save_state_dict(state, tmp)
    return files.finish_save(root, iteration, tmp, entries, "torch_dist")[0]


def load_model_shard(root: str, step: int | None = None, tp: int = 1) -> tuple[dict, torch.nn.Module]:
    """(stored args, GPTModel at TP = ``tp`` x PP = 1 holding this rank's TP shard) of a torch_dist
    checkpoint saved at any layout, for decoding (models/gpt/generate.py, tools/generate.py):
    dist_checkpointing reads the pieces of this shard only (the keys are global, so it reshards).
    The world size must be a multiple of ``tp``; the other factor is data parallel. Collective over
    the world (a one-rank gloo group is made if none exists)."""
    from megatron.core import dist_checkpointing

    from ..groups import initialize_model_parallel

    folder, _ = checkpoint_folder(root, step)
    common = dist_checkpointing.load_common_state_dict(folder)
    if "args" not in common:
        raise CheckpointError(f"{folder}/common.pt: no 'args' (the model settings travel there)")
    stored = dict(common["args"] if isinstance(common["args"], dict) else vars(common["args"]))
    check_tensor_parallel(stored, tp, dist.get_world_size())
    initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    model = _stored_model(stored, tp)
    sharded = {k: v for k, v in model.sharded_state_dict(prefix="").items() if not k.endswith(EXTRA_STATE)}
    with cuda_on_cpu():
        loaded = dist_checkpointing.load({"model": sharded}, folder)
    missing = [k for k in model.load_state_dict(loaded["model"], strict=False).missing_keys if EXTRA_STATE not in k]
    if missing:
        raise CheckpointError(f"{folder}: no tensors for {missing}")
    return stored, model


def check_tensor_parallel(stored: dict, tp: int, world_size: int) -> None:
    """Refuse a --tensor-model-parallel-size the stored model or the world cannot be split by, naming why."""
    groups = stored.get("num_query_groups") if stored.get("group_query_attention") else None
    sizes = {
        "the world size": world_size,
        "num_attention_heads": stored.get("num_attention_heads"),
        "num_query_groups": groups,
        "ffn_hidden_size": stored.get("ffn_hidden_size"),
        "padded_vocab_size": stored.get("padded_vocab_size"),
    }
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    for what, size in sizes.items():
        if size is not None and size % tp:
            raise ValueError(f"--tensor-model-parallel-size {tp} does not divide {what} ({size})")
