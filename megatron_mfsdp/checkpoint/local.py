"""``--ckpt-format torch``: one file per rank of this exact layout, fast to write and read, for every
backend.

``SAVE/iter_0000100/rank_00000.pt`` holds the rank's model, optimizer state, scheduler, generator states
and the arguments, all tensors and plain values (read back with ``weights_only=True``). The folder is
written like a torch_dist one (files.py: temporary folder, checksums taken while each rank writes its
file, tracker last). It loads only at the layout that saved it (world size, PP x TP x DP and the model's
pieces are checked).

- MatrixFSDP (and the replicated backend): each unit's parameter segment and the owner optimizer's state.
- megatron-core's DistributedDataParallel: what Megatron-LM's own torch format holds per rank
  (megatron/training/checkpointing.py at core_v0.16.1: the model chunks' state dicts and the optimizer's
  ``state_dict``, plus, with --use-distributed-optimizer, each DistributedOptimizer's parameter state;
  Megatron-LM gathers that to DP rank 0 into ``distrib_optim.pt``, here every rank keeps its own shard,
  ``get_parameter_state_dp_reshardable``, in its file). Transformer Engine's ``_extra_state`` is left out
  (FP8 does not run on this backend: validation turns it off with a notice).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import integrity, resume
from . import state as ckpt_state
from .settings import CheckpointSettings


def rank_file(rank: int) -> str:
    """The file of ``rank``, relative to the iteration folder."""
    return f"rank_{rank:05d}.pt"


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, rank_file(rank))


def _megatron_ddp(chunks) -> bool:
    return not hasattr(chunks[0], "units")


def _members(optimizer) -> list:
    """megatron-core's optimizers inside ``optimizer`` (a ChainedOptimizer's, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(member) -> bool:
    return hasattr(member, "get_parameter_state_dp_reshardable")


def _parameter_state(member) -> dict:
    """A DistributedOptimizer's shard of this rank, every element marked as no padding (what
    load_parameter_state_from_dp_reshardable expects of each element)."""
    state = member.get_parameter_state_dp_reshardable()
    for key, per_dtype in state.items():
        if isinstance(key, int):
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for element in bucket:
                        element["padding"] = False
    return state


def _model_pieces(chunks) -> list:
    """What must match for a file to load: MatrixFSDP's plan digests, or the DDP chunks' parameter shapes."""
    if not _megatron_ddp(chunks):
        return [chunk.plan_digest() for chunk in chunks]
    return [[[name, list(p.shape)] for name, p in chunk.module.named_parameters()] for chunk in chunks]


def _model_state(chunks) -> list:
    if not _megatron_ddp(chunks):
        return [unit.param_segment.clone() for chunk in chunks for unit in chunk.units]
    return [
        {k: v.detach().clone() for k, v in chunk.module.state_dict().items() if not k.endswith("_extra_state")}
        for chunk in chunks
    ]


def rank_state(
    settings: CheckpointSettings,
    iteration: int,
    chunks,
    optimizer,
    scheduler,
    consumed,
    layout=None,
    flops: float = 0.0,
) -> dict:
    """This rank's whole state, with ``settings.run_args`` as its args; ``layout`` is [PP, TP, DP]
    (checkpoint/dist.py layout_sizes), ``flops`` the floating-point operations so far."""
    saved_args = dict(settings.run_args)
    saved_args["consumed_train_samples"], saved_args["consumed_valid_samples"] = consumed
    state = {
        "iteration": iteration,
        "world_size": dist.get_world_size(),
        "layout": layout,
        "plan_digest": _model_pieces(chunks),
        "model": _model_state(chunks),
        "optimizer": optimizer.state_dict()
        if not _megatron_ddp(chunks)
        else [m.state_dict() for m in _members(optimizer)],
        "opt_param_scheduler": scheduler.state_dict(),
        "rng": ckpt_state.rng_tensors(),
        "args": saved_args,
        "num_floating_point_operations_so_far": flops,
    }
    if _megatron_ddp(chunks):
        state["param_state"] = [_parameter_state(m) if _is_distributed(m) else None for m in _members(optimizer)]
    return state


def save_rank_file(folder: str, state: dict) -> dict:
    """Write this rank's file, hashing the bytes as torch.save hands them over (no read-back), and
    fsync it; returns its manifest entry {file: entry}."""
    rank = dist.get_rank()
    with integrity.HashingWriter(_path(folder, rank), rank) as f:
        torch.save(state, f)
    return {rank_file(rank): f.entry()}


def read_args(folder: str) -> dict:
    return torch.load(_path(folder, 0), map_location="cpu", weights_only=True)["args"]


def _check_layout(path: str, state: dict, chunks, layout) -> None:
    same = (
        state["world_size"] == dist.get_world_size()
        and state["plan_digest"] == _model_pieces(chunks)
        and state.get("layout", layout) == layout
    )
    if not same:
        raise ValueError(
            f"--load: {path} was saved with another layout (world size, PP x TP x DP, planner, parameter rules, "
            "Q/K/V owners or backend); --ckpt-format torch loads only at the layout that saved it, torch_dist "
            "(the default) at any"
        )


def _load_model(chunks, model: list) -> None:
    with torch.no_grad():
        if not _megatron_ddp(chunks):
            for unit, segment in zip([u for chunk in chunks for u in chunk.units], model):
                unit.param_segment.copy_(segment)
            return
        for chunk, tensors in zip(chunks, model):
            missing, unexpected = chunk.module.load_state_dict(tensors, strict=False)
            wrong = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
            if wrong:
                raise ValueError(f"--load: the model's state differs from this run's: {sorted(wrong)[:5]}")


@torch.no_grad()
def _load_optimizer(chunks, optimizer, state: dict) -> None:
    if not _megatron_ddp(chunks):
        optimizer.load_state_dict(state["optimizer"])
        return
    from ..compat.cpu import cuda_on_cpu

    with cuda_on_cpu():  # megatron-core's optimizers allocate on "cuda"
        for member, saved, param_state in zip(_members(optimizer), state["optimizer"], state["param_state"]):
            if _is_distributed(member):
                _load_distributed(member, saved, param_state)
            else:
                _load_local(member, saved)


# What tells megatron-core's parameter groups apart (optimizer.py's param_group_identifier_keys plus the
# learning rates of each): megatron-core 0.16.1 matches saved groups to the run's by the first four only,
# which --decoupled-lr's group shares with the default one, so its own load_state_dict would mix them up.
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr", "default_config")


def _load_local(member, saved: dict) -> None:
    """A Float16OptimizerWithFloat16Params or FP32Optimizer of the same layout: its torch optimizer's state
    (groups matched by position, as torch does), grad scaler and fp32 main weights, as its load_state_dict
    does after matching the groups (megatron/core/optimizer/optimizer.py at core_v0.16.1)."""
    inner = saved.get("optimizer", saved)
    member.optimizer.load_state_dict(inner)
    if saved.get("grad_scaler") is not None and getattr(member, "grad_scaler", None) is not None:
        member.grad_scaler.load_state_dict(saved["grad_scaler"])
    for current, loaded in zip(getattr(member, "fp32_from_float16_groups", []), saved.get("fp32_from_fp16_params", [])):
        for param, value in zip(current, loaded):
            param.data.copy_(value)


def _load_distributed(member, saved: dict, param_state: dict) -> None:
    """A DistributedOptimizer: its load_state_dict and this rank's parameter state (with Megatron-LM's
    torch format, megatron/training/checkpointing.py at core_v0.16.1: load_state_dict, then the parameter
    state); the groups' own settings are then put back (its load matches groups by _GROUP_KEYS' first four,
    see above) and each parameter gets a step tensor of its own."""
    own = [{k: g[k] for k in _GROUP_KEYS if k in g} for g in member.optimizer.param_groups]
    member.load_state_dict(saved)
    for group, settings in zip(member.optimizer.param_groups, own):
        group.update(settings)
    for param_state_of in member.optimizer.state.values():  # its load gives every parameter ONE shared step
        if "step" in param_state_of:  # tensor, which torch's Adam would then advance once per parameter
            param_state_of["step"] = param_state_of["step"].clone()
    member.load_parameter_state_from_dp_reshardable(param_state)


def load_rank_file(settings: CheckpointSettings, folder: str, chunks, optimizer, scheduler, layout=None) -> dict:
    """Load this rank's file (already checksum-verified) into the job; returns the saved state."""
    path = _path(folder, dist.get_rank())
    if not os.path.isfile(path):
        raise ValueError(f"--load: {path} is missing (saved with another world size? use --ckpt-format torch_dist)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    resume.check_same_model(settings.run_args, state["args"], path)
    _check_layout(path, state, chunks, layout)
    _load_model(chunks, state["model"])
    if not (settings.finetune or settings.no_load_optim):
        resume.check_schedule(settings, scheduler, state["opt_param_scheduler"], state["args"], folder)
        _load_optimizer(chunks, optimizer, state)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()
    if not (settings.finetune or settings.no_load_rng):
        ckpt_state.set_rng_tensors(state["rng"])
    return state
