"""Saving and loading a training job's checkpoint (collective), for both formats and every backend:
MatrixFSDP (with or without owner sharding) and megatron-core's DDP + DistributedOptimizer."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from . import dist as torch_dist
from . import files, integrity, local, progress_log, resume
from . import state as ckpt_state
from .settings import CheckpointSettings


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


def common_state(
    settings: CheckpointSettings,
    iteration: int,
    scheduler,
    consumed: tuple[int, int],
    megatron_ddp: bool,
    groups,
    flops: float = 0.0,
) -> dict:
    """Megatron-LM's common keys (args, checkpoint_version, iteration, the floating-point operations so far,
    opt_param_scheduler) in plain values."""
    args_plain = dict(settings.run_args)
    args_plain["consumed_train_samples"], args_plain["consumed_valid_samples"] = consumed
    out = {
        "args": args_plain,
        "checkpoint_version": ckpt_state.CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": flops,
        "mfsdp": {"layout": torch_dist.layout_sizes(groups), "megatron_ddp": megatron_ddp},
    }
    if scheduler is not None and not settings.no_save_optim:
        out["opt_param_scheduler"] = scheduler.state_dict()
    return out


def build_state(
    settings: CheckpointSettings, iteration, chunks, optimizer, scheduler, consumed, groups=None, flops: float = 0.0
) -> dict:
    """The whole sharded state dict of one rank for dist_checkpointing.save."""
    megatron_ddp = _is_megatron_ddp(chunks)
    groups = _groups(chunks, groups)
    state = common_state(settings, iteration, scheduler, consumed, megatron_ddp, groups, flops)
    model = torch_dist.sharded_model(chunks, megatron_ddp)
    state.update(model)
    if optimizer is not None and not settings.no_save_optim:
        state["optimizer"] = torch_dist.sharded_optimizer(optimizer, model, megatron_ddp, is_loading=False)
    if not settings.no_save_rng:
        state[torch_dist.RNG_KEY] = torch_dist.rng_sharded(ckpt_state.rng_tensors(), groups)
    return state


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory for the writer: pinned and filled asynchronously from a device
    (synchronized in :func:`_host_snapshot`), a plain clone on the host."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


def _snapshot(value):
    """Copy every tensor a save will write to host memory, so training may change the originals
    meanwhile (--async-save) and no device memory is spent on the copy."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing import ShardedTensor

    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, ShardedTensor):
        return replace(value, data=_host_copy(value.data))
    if isinstance(value, torch.Tensor):
        return _host_copy(value)
    return value


def _host_snapshot(state: dict) -> dict:
    """:func:`_snapshot`, and the device's copies finished before training changes the originals."""
    snapshot = _snapshot(state)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return snapshot


class _Pending:
    """An asynchronous save: its writer thread (which writes and hashes this rank's files) and what
    finishes it."""

    def __init__(self, request, save_dir: str, iteration: int, tmp: str, retire=None):
        self.request, self.save_dir, self.iteration, self.tmp = request, save_dir, iteration, tmp
        self.retire = retire
        self.error: BaseException | None = None
        self.entries: dict = {}
        self.started = time.perf_counter()
        self.returned_at: float | None = None  # when training resumed
        self.written_at: float | None = None
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            self.entries = torch_dist.write_own_files(self.request, self.tmp, preload=False)
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


_LAST_SAVE: dict = {}  # rank 0: the bytes each rank wrote and hashed at this process's last save


def _retire_settings(settings: CheckpointSettings) -> tuple[int, bool] | None:
    """(--save-retain-interval, --log-progress), or None without --save-retain-interval."""
    retain = settings.save_retain_interval
    return None if retain is None else (retain, bool(settings.log_progress))


def _publish(save_dir: str, iteration: int, tmp: str, fmt: str, entries: dict, retire=None) -> str:
    """Manifest of every rank's entries, rename into place, tracker (never backwards): collective.
    Rank 0 keeps the largest rank's share for the save line and the time-out line, and with
    ``retire`` (:func:`_retire_settings`) removes the checkpoint the tracker named before, with
    --log-progress saying so in progress.txt (Megatron-LM's _async_delete_checkpoint_impl at HEAD)."""
    previous = files.read_tracker(save_dir) if dist.get_rank() == 0 else None
    final, manifest = files.finish_save(save_dir, iteration, tmp, entries, fmt)
    if retire is not None and dist.get_rank() == 0 and files.retire(save_dir, previous, iteration, retire[0]):
        if retire[1]:
            progress_log.append(save_dir, f"Deleted checkpoint\tIteration: {previous}", barrier=False)
    if manifest is not None:
        per_rank = integrity.rank_bytes(manifest["files"])
        rank, largest = max(per_rank.items(), key=lambda kv: (kv[1], -kv[0]))
        _LAST_SAVE.update(folder=final, largest=largest, largest_rank=rank, rank0=per_rank.get(0, 0))
    return final


def _shares() -> str:
    if "largest" not in _LAST_SAVE:
        return ""
    return (
        f"largest rank share {_LAST_SAVE['largest'] / 1e9:.3f} GB written and hashed (rank "
        f"{_LAST_SAVE['largest_rank']}), rank 0 {_LAST_SAVE['rank0'] / 1e9:.3f} GB"
    )


def save_checkpoint(
    settings: CheckpointSettings,
    iteration: int,
    chunks,
    optimizer,
    scheduler,
    consumed=(0, 0),
    groups=None,
    flops: float = 0.0,
) -> str:
    """Save into ``settings.save`` in ``settings.ckpt_format``, with ``settings.run_args`` as the
    checkpoint's args; with ``settings.async_save`` the write runs in the background (finished by
    :func:`finalize_async_save`). Collective. Returns the final folder.
    ``flops``: the floating-point operations of the training so far (Megatron-LM's
    num_floating_point_operations_so_far)."""
    finalize_async_save(blocking=True)
    start = time.perf_counter()
    tmp = _begin(settings.save, iteration)
    if settings.ckpt_format == "torch":
        entries, error = {}, None
        try:
            layout = torch_dist.layout_sizes(_groups(chunks, groups))
            state = local.rank_state(settings, iteration, chunks, optimizer, scheduler, consumed, layout, flops)
            entries = local.save_rank_file(tmp, state)
        except Exception as err:  # noqa: BLE001 - agreed below: no rank may wait alone in the gather
            error = f"writing {tmp}: {err}"
        integrity.agree(error)
        final = _publish(settings.save, iteration, tmp, "torch", entries, _retire_settings(settings))
    else:
        state = build_state(settings, iteration, chunks, optimizer, scheduler, consumed, groups, flops)
        if settings.async_save:
            request = torch_dist.save_request(_host_snapshot(state), tmp)
            _PENDING.append(_Pending(request, settings.save, iteration, tmp, _retire_settings(settings)))
            _PENDING[-1].returned_at = time.perf_counter()
            return files.iteration_dir(settings.save, iteration)
        entries = torch_dist.save_state_dict(state, tmp)
        final = _publish(settings.save, iteration, tmp, "torch_dist", entries, _retire_settings(settings))
    _print0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {settings.save} "
        f"[ {time.perf_counter() - start:.2f} s, {_shares()} ]"
    )
    return final


def finalize_async_save(blocking: bool = False) -> int | None:
    """Finish an asynchronous save once every rank's writer is done (collective: one all-reduce of
    (not done, failed); a failure on any rank stops every rank with its text). Returns the iteration
    of the save it finished, or None."""
    if not _PENDING:
        return None
    pending = _PENDING[0]
    if blocking:
        pending.thread.join()
    flags = [int(pending.thread.is_alive()), int(pending.error is not None)]
    state = torch.tensor(flags, dtype=torch.int64, device=integrity.collective_device())
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    if state[0].item():
        return None
    _PENDING.pop(0)
    if state[1].item():
        error = None if pending.error is None else f"writing {pending.tmp}: {pending.error}"
        try:
            integrity.agree(error)
        except ValueError as err:
            raise RuntimeError(f"asynchronous save of iteration {pending.iteration} failed: {err}") from pending.error
    torch_dist.finish_request(pending.request)
    _publish(pending.save_dir, pending.iteration, pending.tmp, "torch_dist", pending.entries, pending.retire)
    resumed, written = pending.returned_at - pending.started, pending.written_at - pending.started
    _print0(
        f"  successfully saved checkpoint from iteration {pending.iteration:7d} to {pending.save_dir} "
        f"(asynchronously: training resumed after {resumed:.4f} s, the write finished after {written:.4f} s; "
        f"{_shares()})"
    )
    return pending.iteration


def _verified_folder(settings: CheckpointSettings, folder: str) -> dict:
    """Every rank checks its share of the files before anything is read (files.verify_collective);
    a failure on any rank stops every rank, naming the file. --no-verify-checkpoint-integrity
    reads the manifest only."""
    try:
        return files.verify_collective(folder, foreign_ok=True, verify=settings.verify_checkpoint_integrity)
    except ValueError as err:
        raise ValueError(f"--load {settings.load}: {err}") from None


def _what_to_load(settings: CheckpointSettings, common: dict, groups) -> tuple[bool, bool]:
    """(optimizer and scheduler, generator states), by Megatron-LM's flags; RNG states of another
    layout cannot be placed and are skipped with a notice, as Megatron-LM does."""
    load_optim = not (settings.finetune or settings.no_load_optim) and "opt_param_scheduler" in common
    load_rng = not (settings.finetune or settings.no_load_rng)
    saved_layout = common.get("mfsdp", {}).get("layout")  # Megatron-LM's own RNG states are objects: not read
    if load_rng and saved_layout != torch_dist.layout_sizes(groups):
        _print0(
            f"> not loading the generator states: saved at PP x TP x DP = {saved_layout}, "
            f"this run is {torch_dist.layout_sizes(groups)}"
        )
        load_rng = False
    return load_optim, load_rng


def _load_dist(settings: CheckpointSettings, folder: str, chunks, optimizer, scheduler, groups) -> dict:
    common = torch_dist.load_common(folder)
    resume.check_same_model(settings.run_args, common["args"], os.path.join(folder, "common.pt"))
    load_optim, load_rng = _what_to_load(settings, common, groups)
    if not load_optim and any(getattr(u, "codec", None) is not None for c in chunks for u in getattr(c, "units", [])):
        raise ValueError(
            f"--load {folder}: FP8 parameters take their weights from the fp32 masters; load the optimizer"
        )
    if load_optim and scheduler is not None:
        resume.check_schedule(settings, scheduler, common["opt_param_scheduler"], common["args"], folder)
    megatron_ddp = _is_megatron_ddp(chunks)
    request = torch_dist.sharded_model(chunks, megatron_ddp)
    if load_optim:
        request["optimizer"] = torch_dist.sharded_optimizer(optimizer, dict(request), megatron_ddp, is_loading=True)
    rng = ckpt_state.rng_tensors()
    if load_rng:
        request[torch_dist.RNG_KEY] = torch_dist.rng_sharded(rng, groups)
    loaded = torch_dist.load_state_dict(request, folder, settings.dist_ckpt_strictness)
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


def load_checkpoint(settings: CheckpointSettings, chunks, optimizer, scheduler, groups=None) -> dict | None:
    """Load ``settings.load`` (the tracker's iteration, or ``--ckpt-step``) into this job. Returns None
    when there is no checkpoint, else {'iteration', 'consumed_train', 'consumed_valid', 'args'}.
    Every file is checked against its checksum first; a checkpoint of another model shape, a
    changed schedule (see resume.check_schedule) or a damaged file stops with the file named.
    'flops' is the floating-point operations of the training so far (Megatron-LM's
    num_floating_point_operations_so_far; --log-progress), the checkpoint's even with --finetune or
    --pretrained-checkpoint (load_checkpoint in megatron/training/checkpointing.py, HEAD and core_v0.16.1)."""
    target = files.load_target(settings.load, settings.ckpt_step)
    if target is None:
        return None
    folder, iteration = target
    start = time.perf_counter()
    manifest = _verified_folder(settings, folder)
    if manifest.get("format") == "torch":
        layout = torch_dist.layout_sizes(_groups(chunks, groups))
        common = local.load_rank_file(settings, folder, chunks, optimizer, scheduler, layout)
    else:
        common = _load_dist(settings, folder, chunks, optimizer, scheduler, _groups(chunks, groups))
    saved = common["args"]
    flops = common.get("num_floating_point_operations_so_far", 0)  # kept by --finetune too, as Megatron-LM does
    _print0(
        f"  successfully loaded checkpoint from {settings.load} at iteration {iteration} "
        f"[ {time.perf_counter() - start:.2f} s ]"
    )
    return {
        "iteration": 0 if settings.finetune else iteration,
        "consumed_train": 0 if settings.finetune else saved.get("consumed_train_samples", 0),
        "consumed_valid": 0 if settings.finetune else saved.get("consumed_valid_samples", 0),
        "args": saved,
        "flops": flops,
    }


def read_checkpoint_args(load_dir: str, ckpt_step: int | None = None) -> dict | None:
    """The arguments a checkpoint was saved with (for --use-checkpoint-args), verified first."""
    target = files.load_target(load_dir, ckpt_step)
    if target is None:
        return None
    folder = target[0]
    manifest = files.read_manifest(folder, foreign_ok=True)
    rel = local.rank_file(0) if manifest.get("format") == "torch" else "common.pt"
    if rel in manifest["files"]:  # the one file read here, checked by every rank that reads it
        error = integrity.check_files(folder, manifest, [rel])
        if error:
            raise ValueError(f"--load {load_dir}: {error}")
    if manifest.get("format") == "torch":
        return local.read_args(folder)
    return torch_dist.load_common(folder)["args"]
