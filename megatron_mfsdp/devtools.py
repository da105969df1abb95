"""Helpers shared by the tests and the benchmarks: run a function on several
gloo processes, and count the torch.distributed collectives made in a block
(how the tests prove the optimizer step moves no tensor data)."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
import warnings
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
               "broadcast_object_list", "barrier", "all_reduce_coalesced")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, threads, fn, args, out_dir):
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=600))
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, fn: Callable, *args, threads: Optional[int] = None,
                timeout: float = 900) -> List:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes
    (``threads`` intra-op threads each, default 1); return every rank's result, or
    raise with the first failing rank's traceback."""
    import time

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, threads or 1, fn, args, out_dir))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = sorted(f for f in os.listdir(out_dir) if f.startswith("error"))
        if errors:
            with open(os.path.join(out_dir, errors[0])) as f:
                raise RuntimeError(f"worker failed ({errors[0]}):\n{f.read()}")
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"worker exit codes {[p.exitcode for p in procs]} (timeout {timeout}s?)")
        return [torch.load(os.path.join(out_dir, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]


class count_collectives:
    """Record every torch.distributed collective made inside the block as
    (name, tensor elements passed); ``with count_collectives() as calls: ...``."""

    def __enter__(self) -> list:
        self.calls = []
        self._saved = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, _name=name, _fn=fn, **kwargs):
                numel = sum(a.numel() for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
                self.calls.append((_name, numel))
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self.calls

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False
