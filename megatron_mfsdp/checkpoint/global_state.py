"""The whole model at 1 x 1 x 1, in one process: what tools/checkpoint/convert.py reads and writes.

``read_global_state`` loads any torch_dist checkpoint (any layout that saved it) into the unsplit
model that its own arguments describe and returns its tensors by global name (the 1 x 1 x 1
GPTModel's parameter names). ``write_global_state`` writes such tensors as a torch_dist checkpoint
that a training job loads at any layout (model weights only: resume it with --finetune or
--no-load-optim, as a converted Megatron-LM checkpoint)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import dist as torch_dist
from . import files
from .state import CHECKPOINT_VERSION


def _single_process() -> None:
    """A world of one (gloo) and megatron's 1 x 1 x 1 groups, unless the caller has them."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("read_global_state/write_global_state run in one process (world size 1)")
    from ..groups import initialize_model_parallel

    initialize_model_parallel(1, 1, None, create_gloo_process_groups=False)


def build_unsplit_model(args: dict):
    """The 1 x 1 x 1 GPTModel that a checkpoint's arguments describe (weights uninitialized)."""
    from ..models.gpt import build_gpt_model
    from ..models.gpt.config import gpt_model_kwargs, transformer_config_from_args

    _single_process()
    plain = dict(args, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False)
    plain["virtual_pipeline_model_parallel_size"] = None
    config = transformer_config_from_args(plain)
    return build_gpt_model(
        config,
        vocab_size=args["padded_vocab_size"],
        max_sequence_length=args["max_position_embeddings"],
        use_transformer_engine=False,
        **gpt_model_kwargs(plain),
    )


def read_global_state(load_dir: str, iteration: int | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the saved arguments, {global parameter name: full tensor}) of a torch_dist checkpoint."""
    iteration = files.read_tracker(load_dir) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint found in {load_dir} ({files.TRACKER} is missing)")
    folder = files.iteration_dir(load_dir, iteration)
    manifest = files.verify_manifest(folder, foreign_ok=True)
    if manifest.get("format") != "torch_dist":
        raise ValueError(f"{folder}: read_global_state reads --ckpt-format torch_dist checkpoints")
    args = torch_dist.load_common(folder)["args"]
    model = build_unsplit_model(args)
    request = {
        "model": {
            k: v
            for k, v in model.sharded_state_dict().items()
            if hasattr(v, "data") and isinstance(v.data, torch.Tensor)
        }
    }
    loaded = torch_dist.load_state_dict(request, folder, "assume_ok_unexpected")
    model.load_state_dict(loaded["model"], strict=False)
    return args, {name: p.detach().clone() for name, p in model.named_parameters()}


def write_global_state(save_dir: str, args: dict, tensors: dict[str, torch.Tensor], iteration: int = 0) -> str:
    """Write full tensors by global name as a torch_dist checkpoint (tracker, checksums, common
    state with ``args``). Every parameter of the model ``args`` describes must be given."""
    model = build_unsplit_model(args)
    params = dict(model.named_parameters())
    missing, unknown = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unknown:
        raise ValueError(f"write_global_state: missing tensors {missing}, unknown tensors {unknown}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(
                    f"write_global_state: {name} has shape {tuple(tensors[name].shape)}, "
                    f"the model's is {tuple(p.shape)}"
                )
            p.copy_(tensors[name])
    sharded = {
        k: v for k, v in model.sharded_state_dict().items() if hasattr(v, "data") and isinstance(v.data, torch.Tensor)
    }
    state = {
        "args": dict(args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "mfsdp": {"layout": [1, 1, 1], "megatron_ddp": False},
        "model": sharded,
    }
    os.makedirs(save_dir, exist_ok=True)
    files.remove_leftovers(save_dir)
    tmp = files.temporary_dir(save_dir, iteration)
    os.makedirs(tmp)
    torch_dist.save_state_dict(state, tmp)
    files.write_manifest(tmp, {"iteration": iteration, "format": "torch_dist"})
    final = files.iteration_dir(save_dir, iteration)
    files.publish(tmp, final)
    files.write_tracker(save_dir, iteration)
    return final
