"""``--ckpt-format torch_dist``: megatron-core dist_checkpointing in Megatron-LM's layout.

Every tensor is a megatron-core ShardedTensor under megatron-core's GPTModel key (the unsplit
model's name, layers stacked on a leading axis, TP offsets, SwiGLU fc1 as two halves), narrowed to
the element range this rank owns (``flattened_range``); masters and moments use
DistributedOptimizer's ``optimizer.state.<name>.<key>`` keys. What one TP x PP x DP layout saved,
any other reads. Non-tensor state (arguments, step counts, the scheduler) is plain values in
megatron-core's common state; generator states are per-rank tensors."""

from __future__ import annotations

import queue

import torch
import torch.distributed as dist

from ..compat.cpu import cuda_on_cpu
from . import integrity

RNG_KEY = "rng_state"


def _layout(groups) -> dict:
    from ..groups import group_rank, group_size

    return {
        name: (group_rank(g), group_size(g)) for name, g in (("pp", groups.pp), ("tp", groups.tp), ("dp", groups.dp))
    }


def layout_sizes(groups) -> list[int]:
    """[PP, TP, DP] of this job."""
    return [size for _, size in _layout(groups).values()]


def rng_sharded(states: dict[str, torch.Tensor], groups) -> dict:
    """One row per (PP, TP, DP) rank of every generator state."""
    from megatron.core.dist_checkpointing import ShardedTensor

    (pp, pps), (tp, tps), (dp, dps) = _layout(groups).values()
    return {
        name: ShardedTensor.from_rank_offsets(
            f"{RNG_KEY}.{name}", t, (0, pp, pps), (1, tp, tps), (2, dp, dps), replica_id=0, prepend_axis_num=3
        )
        for name, t in states.items()
    }


def model_key(index: int, count: int) -> str:
    """Megatron-LM's state-dict key of a model chunk: ``model``, or ``model0``, ``model1``... with VP."""
    return "model" if count == 1 else f"model{index}"


def sharded_model(chunks, megatron_ddp: bool) -> dict:
    """Each chunk's megatron-core keys: ours through MatrixFSDP, megatron-core DDP's from the model it
    wraps (as Megatron-LM's checkpoints, which carry no ``module.`` prefix)."""
    from megatron.core.dist_checkpointing import ShardedObject

    out = {}
    for i, chunk in enumerate(chunks):
        with cuda_on_cpu():
            sharded = (chunk.module if megatron_ddp else chunk).sharded_state_dict()
        # Tensors only: the layers' _extra_state objects (None without Transformer Engine) would be pickled.
        out[model_key(i, len(chunks))] = {k: v for k, v in sharded.items() if not isinstance(v, ShardedObject)}
    return out


def _allocate_megatron_state(optimizer) -> None:
    """megatron-core's DistributedOptimizer reads its step count from the torch optimizer's state, which
    a fresh job has not made yet (Megatron-LM's GPU runs use Apex/TE's); one step of zero gradients
    makes it, and the load then overwrites masters, moments and step. Its other optimizers (FP32Optimizer,
    Float16OptimizerWithFloat16Params, without --use-distributed-optimizer) make their state themselves in
    ``sharded_state_dict(is_loading=True)`` (optimizer.py at core_v0.16.1: init_state_fn)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not inner.optimizer.state and hasattr(inner, "_init_optimizer_states_with_dummy_values"):
            inner._init_optimizer_states_with_dummy_values()


def sharded_optimizer(optimizer, model_sd: dict, megatron_ddp: bool, is_loading: bool):
    """Ours: masters and moments by owner range. megatron-core's: its own DistributedOptimizer in
    'fully_reshardable' (Megatron-LM's --dist-ckpt-optim-fully-reshardable), whose keys ours use."""
    if megatron_ddp:
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        if is_loading:
            _allocate_megatron_state(optimizer)
        with cuda_on_cpu():
            return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"state": optimizer.sharded_state_dict(), "common": optimizer.common_state_dict()}


def _in_process_results_queue() -> None:
    """megatron-core's filesystem writer hands its write results to the caller through a queue
    that its first save makes as a ``spawn`` Manager (filesystem_async._get_write_results_queue):
    a server process per rank that re-imports the main module (its cost: benchmarks/results/
    checkpoint.md). Our saves put and take those results in this process (synchronously, or in
    the async writer's thread), so a plain in-process queue serves; it is set before the first."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_request(state: dict, folder: str):
    """megatron-core's save of ``state`` into ``folder`` as an AsyncRequest: the plan (collective)
    and rank 0's common.pt now; this rank's writes in :func:`write_own_files`, whenever the caller
    runs it (at once, or in the --async-save writer thread); then :func:`finish_request`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    _in_process_results_queue()
    with cuda_on_cpu():
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
        return dist_checkpointing.save(state, folder, strategy, async_sharded_save=True)


def write_own_files(request, folder: str, preload: bool) -> dict:
    """Write this rank's files of a save request, then hash them: {path in folder: entry}.

    The hash is taken right after the write returns, in the same thread, from the pages just
    written, not as the bytes go out: megatron-core's writer (FileSystemWriterAsync.
    write_preloaded_data) opens each file itself with the builtin ``open`` in a forked process per
    bucket and offers no hook on the stream but torch's stream-transform extensions, which record
    themselves in ``.metadata`` (a checkpoint Megatron-LM could no longer read); wrapping its stream
    would mean patching or copying megatron-core's writer. The files are this rank's own, so the
    extra pass costs one read of what the rank just wrote, at memory speed while the pages are
    cached. ``preload``: stage device tensors on the host first (megatron-core's own preload_fn,
    as AsyncRequest.execute_sync does); an --async-save snapshot is already on the host."""
    args = list(request.async_fn_args)
    if request.async_fn is None:
        return {}
    with cuda_on_cpu():
        if preload and request.preload_fn is not None:
            args[1] = request.preload_fn()
        request.async_fn(*args, **request.async_fn_kwargs)
    # async_fn_args[1] holds the write buckets, (file path, storage key, data) each: megatron-core's
    # WriteBucket (filesystem_async.py) and AsyncRequest.execute_sync's documented argument.
    return integrity.hash_written(folder, [bucket[0] for bucket in args[1]], dist.get_rank())


def finish_request(request) -> None:
    """megatron-core's finalization (collective): the global metadata and metadata.json, on rank 0."""
    with cuda_on_cpu():
        for fn in request.finalize_fns:
            fn()


def save_state_dict(state: dict, folder: str) -> dict:
    """dist_checkpointing's save into an existing empty folder (collective): this rank writes and
    hashes its files; every rank's write error stops every rank. Returns this rank's entries
    (files.finish_save gathers them into the manifest)."""
    request = save_request(state, folder)
    entries, error = {}, None
    try:
        entries = write_own_files(request, folder, preload=True)
    except Exception as err:  # noqa: BLE001 - agreed below, so that no rank waits in finalize
        error = f"writing {folder}: {err}"
    integrity.agree(error)
    finish_request(request)
    return entries


def load_common(folder: str) -> dict:
    """The common state (rank 0's non-sharded values), read with torch's weights_only loader."""
    import os

    path = os.path.join(folder, "common.pt")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file {path} is missing")
    common = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(common.get("args", {}), dict):  # Megatron-LM stores an argparse.Namespace
        common["args"] = vars(common["args"])
    return common


def load_state_dict(request: dict, folder: str, strict: str) -> dict:
    """dist_checkpointing.load with --dist-ckpt-strictness ``strict``. The return_* modes hand the
    mismatched keys back instead of reporting them; they are printed here (rank 0), so that the
    mode does what its name says instead of breaking the load (Megatron-LM indexes the tuple)."""
    from megatron.core import dist_checkpointing

    with cuda_on_cpu():
        loaded = dist_checkpointing.load(request, folder, strict=strict)
    if not strict.startswith("return_"):
        return loaded
    loaded, missing, unexpected = loaded
    if dist.get_rank() == 0 and (missing or unexpected):
        print(
            f"--dist-ckpt-strictness {strict}: {folder} has {len(missing)} key(s) this run did not ask for "
            f"({_first_keys(missing)}) and lacks {len(unexpected)} it asked for ({_first_keys(unexpected)})",
            flush=True,
        )
    return loaded


def _first_keys(keys, shown: int = 5) -> str:
    """The first ``shown`` of ``keys`` in sorted order, and '...' if there are more."""
    return ", ".join(sorted(keys)[:shown]) + (" ..." if len(keys) > shown else "")


def copy_loaded(request, loaded) -> None:
    """Copy loaded tensors into the request's own tensors where dist_checkpointing returned new ones."""
    from megatron.core.dist_checkpointing import ShardedTensor

    if isinstance(request, dict):
        for key, value in request.items():
            if key in loaded:
                copy_loaded(value, loaded[key])
    elif isinstance(request, (list, tuple)):
        for value, got in zip(request, loaded):
            copy_loaded(value, got)
    elif isinstance(request, ShardedTensor) and isinstance(loaded, torch.Tensor):
        if loaded.data_ptr() != request.data.data_ptr():
            with torch.no_grad():
                request.data.copy_(loaded.reshape(request.data.shape))
