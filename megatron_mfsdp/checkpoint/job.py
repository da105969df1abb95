"""Saving and loading a training job's checkpoint (collective), for both formats and every backend:
MatrixFSDP (with or without owner sharding) and megatron-core's DDP + DistributedOptimizer."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from . import dist as torch_dist
from . import files, local, resume
from . import state as ckpt_state


def _print0(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _is_megatron_ddp(chunks) -> bool:
    return not hasattr(chunks[0], "units")


def _groups(chunks, groups):
    """The job's ProcessGroups (given, or the MatrixFSDP chunks'; a single data-parallel world otherwise)."""
    from ..groups import ProcessGroups

    if groups is not None:
        return groups
    return chunks[0].groups if hasattr(chunks[0], "groups") else ProcessGroups.data_parallel_only()


def common_state(args, iteration: int, scheduler, consumed: tuple[int, int], megatron_ddp: bool, groups) -> dict:
    """Megatron-LM's common keys (args, checkpoint_version, iteration, opt_param_scheduler) in plain values."""
    args_plain = ckpt_state.args_dict(args)
    args_plain["consumed_train_samples"], args_plain["consumed_valid_samples"] = consumed
    out = {
        "args": args_plain,
        "checkpoint_version": ckpt_state.CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": 0,
        "mfsdp": {"layout": torch_dist.layout_sizes(groups), "megatron_ddp": megatron_ddp},
    }
    if scheduler is not None and not getattr(args, "no_save_optim", False):
        out["opt_param_scheduler"] = scheduler.state_dict()
    return out


def build_state(args, iteration, chunks, optimizer, scheduler, consumed, groups=None) -> dict:
    """The whole sharded state dict of one rank for dist_checkpointing.save."""
    megatron_ddp = _is_megatron_ddp(chunks)
    groups = _groups(chunks, groups)
    state = common_state(args, iteration, scheduler, consumed, megatron_ddp, groups)
    model = torch_dist.sharded_model(chunks, megatron_ddp)
    state.update(model)
    if optimizer is not None and not getattr(args, "no_save_optim", False):
        state["optimizer"] = torch_dist.sharded_optimizer(optimizer, model, megatron_ddp, is_loading=False)
    if not getattr(args, "no_save_rng", False):
        state[torch_dist.RNG_KEY] = torch_dist.rng_sharded(ckpt_state.rng_tensors(), groups)
    return state


def _snapshot(value):
    """Clone every tensor a save will write, so training may change the originals meanwhile (async)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing import ShardedTensor

    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, ShardedTensor):
        return replace(value, data=value.data.detach().clone())
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


class _Pending:
    """An asynchronous save: its writer thread and what finishes it."""

    def __init__(self, request, save_dir: str, iteration: int, tmp: str):
        self.request, self.save_dir, self.iteration, self.tmp = request, save_dir, iteration, tmp
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.returned_at: float | None = None  # when training resumed
        self.written_at: float | None = None
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            self.request.async_fn(*self.request.async_fn_args)
        except BaseException as err:  # noqa: BLE001 - reported on finalize
            self.error = err
        self.written_at = time.perf_counter()


_PENDING: list[_Pending] = []


def _begin(save_dir: str, iteration: int) -> str:
    tmp = files.temporary_dir(save_dir, iteration)
    if dist.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        for path in files.remove_leftovers(save_dir):
            print(f"> removed {path}: the temporary folder of a save that did not finish", flush=True)
        current = files.read_tracker(save_dir)
        if current is not None and current > iteration:
            print(
                f"> WARNING: {save_dir} already holds iteration {current}; iteration {iteration} is saved "
                f"beside it but {files.TRACKER} keeps pointing at {current}",
                flush=True,
            )
        os.makedirs(tmp)
    dist.barrier()
    return tmp


def _publish(save_dir: str, iteration: int, tmp: str, fmt: str) -> str:
    """Rank 0: checksums, rename into place, tracker (never backwards). Then every rank agrees."""
    final = files.iteration_dir(save_dir, iteration)
    if dist.get_rank() == 0:
        files.write_manifest(tmp, {"iteration": iteration, "format": fmt})
        files.publish(tmp, final)
        files.write_tracker(save_dir, iteration)
    dist.barrier()
    return final


def save_checkpoint(args, iteration: int, chunks, optimizer, scheduler, consumed=(0, 0), groups=None) -> str:
    """Save into ``args.save`` in ``args.ckpt_format``; with ``args.async_save`` the write runs in the
    background (finished by :func:`maybe_finalize_async_save`). Collective. Returns the final folder."""
    finalize_async_save(blocking=True)
    start = time.perf_counter()
    tmp = _begin(args.save, iteration)
    if args.ckpt_format == "torch":
        local.save_rank_file(tmp, local.rank_state(args, iteration, chunks, optimizer, scheduler, consumed))
        dist.barrier()
        final = _publish(args.save, iteration, tmp, "torch")
    else:
        state = build_state(args, iteration, chunks, optimizer, scheduler, consumed, groups)
        if getattr(args, "async_save", False):
            request = torch_dist.async_save_request(_snapshot(state), tmp)
            _PENDING.append(_Pending(request, args.save, iteration, tmp))
            _PENDING[-1].returned_at = time.perf_counter()
            return files.iteration_dir(args.save, iteration)
        torch_dist.save_state_dict(state, tmp)
        dist.barrier()
        final = _publish(args.save, iteration, tmp, "torch_dist")
    _print0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {args.save} "
        f"[ {time.perf_counter() - start:.2f} s ]"
    )
    return final


def finalize_async_save(blocking: bool = False) -> bool:
    """Finish an asynchronous save once every rank's writer is done (collective: one all-reduce).
    Returns whether one was finished."""
    if not _PENDING:
        return False
    pending = _PENDING[0]
    if blocking:
        pending.thread.join()
    done = torch.tensor([0 if pending.thread.is_alive() else 1], dtype=torch.int64)
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    if not done.item():
        return False
    _PENDING.pop(0)
    if pending.error is not None:
        raise RuntimeError(
            f"asynchronous save of iteration {pending.iteration} failed: {pending.error}"
        ) from pending.error
    from ..compat.cpu import cuda_on_cpu

    with cuda_on_cpu():
        for fn in pending.request.finalize_fns:
            fn()
    dist.barrier()
    _publish(pending.save_dir, pending.iteration, pending.tmp, "torch_dist")
    resumed, written = pending.returned_at - pending.started, pending.written_at - pending.started
    _print0(
        f"  successfully saved checkpoint from iteration {pending.iteration:7d} to {pending.save_dir} "
        f"(asynchronously: training resumed after {resumed:.4f} s, the write finished after {written:.4f} s)"
    )
    return True


def _verified_folder(load_dir: str, folder: str) -> dict:
    """Rank 0 checks every file's checksum before anything is read; every rank raises its error."""
    error, manifest = None, None
    if dist.get_rank() == 0:
        try:
            if not os.path.isdir(folder):
                raise ValueError(f"--load {load_dir}: checkpoint folder {folder} does not exist")
            manifest = files.verify_manifest(folder, foreign_ok=True)
        except ValueError as err:
            error = str(err)
    torch_dist.broadcast_error(error)
    box = [manifest]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _what_to_load(args, common: dict, groups) -> tuple[bool, bool]:
    """(optimizer and scheduler, generator states), by Megatron-LM's flags; RNG states of another
    layout cannot be placed and are skipped with a notice, as Megatron-LM does."""
    load_optim = not (args.finetune or args.no_load_optim) and "opt_param_scheduler" in common
    load_rng = not (args.finetune or args.no_load_rng)
    saved_layout = common.get("mfsdp", {}).get("layout")  # Megatron-LM's own RNG states are objects: not read
    if load_rng and saved_layout != torch_dist.layout_sizes(groups):
        _print0(
            f"> not loading the generator states: saved at PP x TP x DP = {saved_layout}, "
            f"this run is {torch_dist.layout_sizes(groups)}"
        )
        load_rng = False
    return load_optim, load_rng


def _load_dist(args, folder: str, chunks, optimizer, scheduler, groups) -> dict:
    common = torch_dist.load_common(folder)
    resume.check_same_model(args, common["args"], os.path.join(folder, "common.pt"))
    load_optim, load_rng = _what_to_load(args, common, groups)
    if not load_optim and any(getattr(u, "codec", None) is not None for c in chunks for u in getattr(c, "units", [])):
        raise ValueError(
            f"--load {folder}: FP8 parameters take their weights from the fp32 masters; load the optimizer"
        )
    if load_optim and scheduler is not None:
        resume.check_schedule(args, scheduler, common["opt_param_scheduler"], common["args"], folder)
    megatron_ddp = _is_megatron_ddp(chunks)
    request = torch_dist.sharded_model(chunks, megatron_ddp)
    if load_optim:
        request["optimizer"] = torch_dist.sharded_optimizer(optimizer, dict(request), megatron_ddp, is_loading=True)
    rng = ckpt_state.rng_tensors()
    if load_rng:
        request[torch_dist.RNG_KEY] = torch_dist.rng_sharded(rng, groups)
    loaded = torch_dist.load_state_dict(request, folder, args.dist_ckpt_strictness)
    _apply(request, loaded, chunks, optimizer, megatron_ddp, load_optim)
    if load_optim and scheduler is not None:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if load_rng:
        torch_dist.copy_loaded(request[torch_dist.RNG_KEY], loaded[torch_dist.RNG_KEY])
        ckpt_state.set_rng_tensors(rng)
    return common


def _from_megatron(saved: dict) -> dict:
    """Our optimizer's common state from a megatron-core DistributedOptimizer's (its step count lives in
    the torch optimizer's lr groups); the lr groups themselves come from the scheduler."""
    groups = saved["optimizer"]["param_groups"]
    return {"step": int(groups[0]["step"]), "param_groups": [], "grad_scaler": None}


def _apply(request, loaded, chunks, optimizer, megatron_ddp: bool, load_optim: bool) -> None:
    from ..compat.cpu import cuda_on_cpu

    for i, chunk in enumerate(chunks):
        key = torch_dist.model_key(i, len(chunks))
        if megatron_ddp:
            chunk.module.load_state_dict(loaded[key], strict=False)
        else:
            torch_dist.copy_loaded(request[key], loaded[key])
    if load_optim and megatron_ddp:
        with cuda_on_cpu():
            optimizer.load_state_dict(loaded["optimizer"])
    elif load_optim:
        optimizer.load_sharded_state_dict(loaded["optimizer"]["state"])
        optimizer.load_common_state_dict(loaded["optimizer"].get("common") or _from_megatron(loaded["optimizer"]))
    elif optimizer is not None:
        optimizer.reload_model_params()


def load_checkpoint(args, chunks, optimizer, scheduler, groups=None) -> dict | None:
    """Load ``args.load`` (the tracker's iteration, or ``--ckpt-step``) into this job. Returns None
    when there is no checkpoint, else {'iteration', 'consumed_train', 'consumed_valid', 'args'}.
    Every file is checked against its checksum first; a checkpoint of another model shape, a
    changed schedule (see resume.check_schedule) or a damaged file stops with the file named."""
    target = files.load_target(args.load, args.ckpt_step)
    if target is None:
        return None
    folder, iteration = target
    start = time.perf_counter()
    manifest = _verified_folder(args.load, folder)
    if manifest.get("format") == "torch":
        common = local.load_rank_file(args, folder, chunks, optimizer, scheduler)
    else:
        common = _load_dist(args, folder, chunks, optimizer, scheduler, _groups(chunks, groups))
    saved = common["args"]
    _print0(
        f"  successfully loaded checkpoint from {args.load} at iteration {iteration} "
        f"[ {time.perf_counter() - start:.2f} s ]"
    )
    return {
        "iteration": 0 if args.finetune else iteration,
        "consumed_train": 0 if args.finetune else saved.get("consumed_train_samples", 0),
        "consumed_valid": 0 if args.finetune else saved.get("consumed_valid_samples", 0),
        "args": saved,
    }


def read_checkpoint_args(load_dir: str, ckpt_step: int | None = None) -> dict | None:
    """The arguments a checkpoint was saved with (for --use-checkpoint-args), verified first."""
    target = files.load_target(load_dir, ckpt_step)
    if target is None:
        return None
    folder = target[0]
    manifest = files.verify_manifest(folder, foreign_ok=True)
    if manifest.get("format") == "torch":
        return local.read_args(folder)
    return torch_dist.load_common(folder)["args"]
