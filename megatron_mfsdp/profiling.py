"""Named ranges for profilers: an NVTX range on CUDA (what nsys shows, with or without
--profile) and a torch.profiler.record_function while a PyTorch profiler records (what a
--use-pytorch-profiler trace shows, on CPU too).

Names, one scheme so a trace can be searched by prefix:
    mfsdp.optimizer.step   the whole optimizer step (unscale, norm, clip, update rules, sync)
    mfsdp.rule <rule>      one parameter group's update rule, e.g. "mfsdp.rule muon"
    mfsdp.gather <unit>    a unit's parameter gather, e.g. "mfsdp.gather layer1" (the layout's unit name)
    mfsdp.reduce <unit>    a unit's gradient reduction
    mfsdp.wait <unit>      waiting on a unit's outstanding collective
"""

from __future__ import annotations

import torch
from torch._C._profiler import ActiveProfilerType

OPTIMIZER_STEP = "mfsdp.optimizer.step"
RULE = "mfsdp.rule {}"
GATHER = "mfsdp.gather {}"
REDUCE = "mfsdp.reduce {}"
WAIT = "mfsdp.wait {}"

_profiler_enabled = torch._C._autograd._profiler_enabled
_profiler_type = torch._C._autograd._profiler_type
_nvtx: list = []  # [bool] once known: CUDA (and so NVTX) on this machine


def _use_nvtx() -> bool:
    if not _nvtx:
        _nvtx.append(torch.cuda.is_available())
    return _nvtx[0]


class profile_range:  # lower case: used like a function, ``with profile_range(name):``
    """``with profile_range(name):`` marks a span for nsys and the PyTorch profiler.

    Cheap when no profiler records, so it can sit on every collective (on CUDA add one NVTX
    push/pop pair). record_function costs several times more even with no profiler, so it is
    entered only while one records (figures: benchmarks/results/cpu_costs.md).
    Under emit_nvtx (--profile's nsys mode) record_function would emit NVTX itself, so then
    only the explicit NVTX range opens (no duplicate ranges in nsys).
    """

    __slots__ = ("name", "_record", "_pushed")

    def __init__(self, name: str):
        self.name = name
        self._record = None
        self._pushed = False

    def __enter__(self) -> profile_range:
        if _use_nvtx():
            torch.cuda.nvtx.range_push(self.name)
            self._pushed = True
        if _profiler_enabled() and _profiler_type() != ActiveProfilerType.NVTX:
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._record is not None:
            self._record.__exit__(*exc)
            self._record = None
        if self._pushed:
            torch.cuda.nvtx.range_pop()
            self._pushed = False
        return False
