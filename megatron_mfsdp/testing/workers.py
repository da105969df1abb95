"""Run a function on several gloo processes; ``count_collectives`` (the torch.distributed calls made
in a block: how the tests prove the optimizer step moves no tensor data) lives in
runtime/call_log.py, which tools/plan.py uses too, and is re-exported here for the tests.

Starting a process that imports torch and megatron-core costs seconds of CPU, which on a
2-core machine dominates a test suite of tiny models. So ``run_workers`` keeps one pool of
gloo processes per (world size, threads) alive for the whole session and sends it one task
after another; each task leaves the process as it found it (deterministic mode off; megatron's
groups kept for the next task of the same layout, and destroyed by ``release_pool_groups``).
``fresh=True`` (or ``MFSDP_FRESH_WORKERS=1``) spawns new processes instead, as the benchmarks do.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import queue
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..runtime.call_log import Call, CallLog, count_collectives  # noqa: F401 - re-exported for the tests

COLLECTIVE_TIMEOUT_S = 300  # a rank stuck in a collective raises after this, instead of hanging


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int, threads: int) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(threads)
    # A rank that torchrun launches starts its DataLoader workers by fork (Linux's default); a
    # spawned pool process would inherit "spawn", and each loader worker would import torch and
    # megatron afresh (seconds each; measured: benchmarks/results/startup.md).
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _run_task(rank: int, world_size: int, fn, fn_args, out_dir: str) -> None:
    failed = False
    try:
        result = fn(rank, world_size, *fn_args)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    except BaseException:
        failed = True
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        for marker in ([f"retire{rank}"] if _reset_process_state(failed) else []) + [f"done{rank}"]:
            with open(os.path.join(out_dir, marker), "w"):
                pass


MAX_THREADS = 150  # a pooled process retires past this many threads (see _reset_process_state)


def _reset_process_state(failed: bool = False) -> bool:
    """Undo what a task may have set up; return whether this process should retire.

    megatron's groups are kept for the next task of the same layout (groups.py), unless the
    task failed (its layout may be half built) or the process holds too many threads: each
    gloo group keeps threads that wake every 10 ms to poll, so then the groups are destroyed,
    and a process still past MAX_THREADS retires (the pool starts afresh). The
    attention-backend variables megatron-core's GPTModel exports are cleared."""
    gc.collect()
    torch.use_deterministic_algorithms(False)
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # GPTModel sets these per backend
        os.environ.pop(name, None)
    if failed or _threads() > MAX_THREADS:
        try:
            from ..groups import forget_layout

            forget_layout()
        except Exception:  # a group that cannot be destroyed: start this process afresh
            return True
    return _threads() > MAX_THREADS


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _fresh_entry(rank, world_size, port, threads, fn, fn_args, out_dir):
    _init(rank, world_size, port, threads)
    try:
        _run_task(rank, world_size, fn, fn_args, out_dir)
    finally:
        dist.destroy_process_group()


def _pool_entry(rank, world_size, port, threads, tasks):
    _init(rank, world_size, port, threads)
    parent = os.getppid()
    while os.getppid() == parent:  # exit with the parent, however it died
        try:
            task = tasks.get(timeout=2)
        except queue.Empty:
            continue
        if task is None:
            break
        _run_task(rank, world_size, *task)
        if os.path.exists(os.path.join(task[2], f"retire{rank}")):
            break
    dist.destroy_process_group()


def _collect(out_dir: str, world_size: int, what: str) -> list:
    errors = {}
    for name in sorted(f for f in os.listdir(out_dir) if f.startswith("error")):
        with open(os.path.join(out_dir, name)) as f:
            errors[name] = f.read()
    if errors:  # the cause, not a peer's "Connection closed by peer" after the cause killed its rank
        name = min(errors, key=lambda n: ("closed by peer" in errors[n] or "Connection reset" in errors[n], n))
        raise RuntimeError(f"worker failed ({name}):\n{errors[name]}")
    missing = [r for r in range(world_size) if not os.path.exists(os.path.join(out_dir, f"result{r}.pt"))]
    if missing:
        raise RuntimeError(f"workers {missing} returned no result ({what})")
    return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


class WorkerPool:
    """``world_size`` gloo processes that run one task after another."""

    def __init__(self, world_size: int, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_pool_entry, args=(r, world_size, port, threads, self.tasks[r]))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.used = False  # ran a task since its groups were last released

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, fn_args: tuple, timeout: float) -> list:
        self.used = True
        with tempfile.TemporaryDirectory() as out_dir:
            for q in self.tasks:
                q.put((fn, fn_args, out_dir))
            deadline = time.monotonic() + timeout
            while not all(os.path.exists(os.path.join(out_dir, f"done{r}")) for r in range(self.world_size)):
                if time.monotonic() > deadline or not self.alive():
                    self.close(kill=True)
                    _collect(out_dir, self.world_size, f"pool died or timed out after {timeout}s")
                    raise RuntimeError(f"worker pool died or timed out after {timeout}s")
                time.sleep(0.01)
            try:
                return _collect(out_dir, self.world_size, "pool")
            except RuntimeError:
                # A failed rank may have left the others' collectives in any state; a lone rank
                # has no others, and its task's groups are gone (_reset_process_state).
                if self.world_size > 1:
                    self.close(kill=True)
                raise
            finally:
                if any(f.startswith("retire") for f in os.listdir(out_dir)):
                    self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if kill:
                _kill_tree(p.pid)
            elif p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError, queue.Full):
                    p.kill()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _kill_tree(pid: int) -> None:
    """Kill a worker and what it started (dist_checkpointing starts a multiprocessing Manager)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


_POOLS: dict[tuple[int, int], WorkerPool] = {}


def _release_groups(rank: int, world_size: int) -> None:
    from ..groups import forget_layout

    forget_layout()


def release_pool_groups() -> None:
    """Destroy every group but the world in each idle pool: the pools stay for the next test
    module (starting ranks costs seconds each), and their idle gloo threads stop polling (what an
    idle pool costs: benchmarks/results/startup.md)."""
    for key, pool in list(_POOLS.items()):
        if pool.alive() and not pool.used:
            continue  # idle since its last release: nothing to destroy (a release costs 0.3 s a pool)
        if pool.alive():
            try:
                pool.run(_release_groups, (), 120)
                pool.used = False
                continue
            except RuntimeError:
                pass
        _POOLS.pop(key).close(kill=True)


@atexit.register
def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(kill=True)  # idle and holding nothing: no need to wait


def run_workers(
    world_size: int, fn: Callable, *args, threads: int | None = None, timeout: float = 900, fresh: bool = False
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (``threads``
    intra-op threads each, default 1); return every rank's result, or raise with the first
    failing rank's traceback. ``fn`` must be importable (a module-level function)."""
    threads = threads or 1
    if fresh or os.environ.get("MFSDP_FRESH_WORKERS") == "1":
        return _run_fresh(world_size, fn, args, threads, timeout)
    pool = _POOLS.get((world_size, threads))
    if pool is None or not pool.alive():
        pool = _POOLS[(world_size, threads)] = WorkerPool(world_size, threads)
    return pool.run(fn, args, timeout)


def _run_fresh(world_size: int, fn: Callable, fn_args: tuple, threads: int, timeout: float) -> list:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_fresh_entry, args=(r, world_size, port, threads, fn, fn_args, out_dir))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return _collect(out_dir, world_size, f"exit codes {[p.exitcode for p in procs]}, timeout {timeout}s")
