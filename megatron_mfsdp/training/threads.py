"""Torch's intra-op thread count per process: the user's ``OMP_NUM_THREADS`` where they set one, else
the host's cores shared among its ranks; said in one start-up line.

The count matters beyond speed: torch's CPU kernels (LayerNorm's backward, MKL's eigh) split their
reductions by thread, so two runs give the same bits only with the same count per process (a job at
DP 1 and DP 2 on one host with cores / local ranks threads each, 2 and 1 on 2 cores, gives LayerNorm
gradients 1-2 ulp apart; with equal counts they are bitwise equal).

The rule (:func:`decide`):

- ``OMP_NUM_THREADS`` set by the user, a positive integer: that many threads.
- Otherwise (unset, or torchrun's own default below): ``max(1, cores // local ranks)``, the ranks on
  this host (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``).
- A value that is not a positive integer is ignored, and the start-up line says so.

torchrun sets ``OMP_NUM_THREADS=1`` itself when it starts more than one process per node and its own
environment had none (torch 2.13 torch/distributed/run.py ``run``, with a warning; the elastic agent,
torch/distributed/elastic/agent/server/local_elastic_agent.py ``_start_workers``, copies it into each
worker's environment). A worker cannot tell that 1 from a user's by its own environment, so
:func:`torchrun_default` reads the environment torchrun (the worker's parent process) started with,
``/proc/<parent pid>/environ`` on Linux, which torchrun's own ``os.environ`` assignment does not
change: no ``OMP_NUM_THREADS`` there means the 1 is torchrun's. Where that file cannot be read (not
Linux), the 1 counts as the user's, as torch itself counts it, and the line says it could not tell.

A caller that created the process group itself (the test workers of megatron_mfsdp/testing/workers.py)
chose its threads too: :func:`startup_line` reports its count as the caller's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

VARIABLE = "OMP_NUM_THREADS"
TORCHRUN_DEFAULT = "1"  # what torchrun sets for --nproc-per-node > 1 when the variable is unset


@dataclass(frozen=True)
class Threads:
    """The count and where it came from, as the start-up line says it."""

    count: int
    source: str


def local_ranks(environ: Mapping[str, str]) -> int:
    """The processes on this host: torchrun's ``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, else 1."""
    return int(environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE", "1")))


def decide(value: str | None, cores: int, ranks: int, torchrun_set: bool | None = False) -> Threads:
    """The rule of the module docstring. ``value``: ``OMP_NUM_THREADS`` (None: unset); ``torchrun_set``:
    whether torchrun set it (:func:`torchrun_default`; None: it could not be told)."""
    shared = Threads(max(1, cores // max(1, ranks)), f"{cores} cores / {ranks} local ranks")
    if value is None:
        return Threads(shared.count, f"{shared.source}; {VARIABLE} unset")
    if not (value.strip().isdigit() and int(value) > 0):
        return Threads(shared.count, f"{shared.source}; {VARIABLE}={value!r} ignored: not a positive integer")
    if torchrun_set:
        why = "torchrun's default for more than one process per node, not yours"
        return Threads(shared.count, f"{shared.source}; {VARIABLE}={value} ignored: {why}")
    unsure = " (yours or torchrun's default: torchrun's environment could not be read)" if torchrun_set is None else ""
    return Threads(int(value), f"{VARIABLE}={value}{unsure}")


def torchrun_default(environ: Mapping[str, str], parent_environ: str | None = None) -> bool | None:
    """Whether ``OMP_NUM_THREADS`` here is torchrun's own 1 (the module docstring): under torchrun
    (``TORCHELASTIC_RUN_ID``) with more than one local rank and the value 1, when torchrun's start-up
    environment (``parent_environ``, default ``/proc/<parent pid>/environ``) lacks the variable. None
    where that file cannot be read."""
    if "TORCHELASTIC_RUN_ID" not in environ or local_ranks(environ) < 2:
        return False
    if environ.get(VARIABLE, "").strip() != TORCHRUN_DEFAULT:
        return False
    path = parent_environ or f"/proc/{os.getppid()}/environ"
    try:
        with open(path, "rb") as f:
            names = {entry.split(b"=", 1)[0] for entry in f.read().split(b"\0") if entry}
    except OSError:
        return None
    return VARIABLE.encode() not in names


def decide_here(environ: Mapping[str, str] | None = None) -> Threads:
    """:func:`decide` for this process's environment and host."""
    environ = os.environ if environ is None else environ
    value = environ.get(VARIABLE)
    torchrun_set = torchrun_default(environ) if value is not None else False
    return decide(value, os.cpu_count() or 1, local_ranks(environ), torchrun_set)


def configure_threads(environ: Mapping[str, str] | None = None) -> Threads:
    """Set torch's intra-op threads by the rule; returns the decision."""
    import torch

    threads = decide_here(environ)
    torch.set_num_threads(threads.count)
    return threads


def startup_line(threads: Threads | None) -> str:
    """The start-up line: the count torch uses and where it came from (``threads`` None: the process
    group, and the threads, were the caller's)."""
    import torch

    source = threads.source if threads is not None else "set by the caller that created the process group"
    return f"> intra-op threads per process: {torch.get_num_threads()} ({source})"
