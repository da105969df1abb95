"""The Newton-Schulz dtype default (issue 20, item 7): decided by the hardware alone (CUDA, or a
bf16 matrix unit in /proc/cpuinfo flags: amx_bf16 or avx512_bf16), never by a timing, so two
launches train with the same numerics; made one across ranks at start-up (fp32 where the ranks'
hardware differs); saved with the checkpoint's args as resolved."""

import time

import pytest
import torch

from megatron_mfsdp.checkpoint.state import args_dict
from megatron_mfsdp.compat import cpu
from megatron_mfsdp.testing import run_workers
from megatron_mfsdp.training import setup
from megatron_mfsdp.training.arguments import parse_args, validate
from tests.launch import TINY

_PIN = TINY.index("--muon-ns-dtype")
BASE = TINY[:_PIN] + TINY[_PIN + 2 :]  # the tiny run's flags without its pinned NS dtype
AMX = ["fpu", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
AVX512_BF16 = ["fpu", "avx512f", "avx512_bf16"]  # no AMX: bf16 Newton-Schulz measured about 2x fp32
NO_UNIT = ["fpu", "avx2", "avx512f"]


def _set_flags(monkeypatch, flags):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: None if flags is None else frozenset(flags))


@pytest.mark.parametrize(
    "flags,fast,reason",
    [
        (AMX, True, "amx_bf16 in /proc/cpuinfo flags"),
        (AVX512_BF16, True, "avx512_bf16 in /proc/cpuinfo flags"),
        (NO_UNIT, False, "no bf16 matrix unit (neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo flags)"),
        (None, False, "no /proc/cpuinfo flags to show a bf16 matrix unit"),
    ],
)
def test_choice_follows_the_flags(monkeypatch, flags, fast, reason):
    _set_flags(monkeypatch, flags)
    assert cpu.bf16_matmul_choice() == (fast, reason)


def test_no_timing_decides(monkeypatch):
    """The probe and its margin are gone, and the choice neither reads a clock nor multiplies."""
    assert not hasattr(cpu, "bf16_matmul_probe") and not hasattr(cpu, "PROBE_MARGIN")

    def boom(*args, **kwargs):
        raise AssertionError("the NS dtype default timed or ran something")

    _set_flags(monkeypatch, AVX512_BF16)  # the case the probe used to decide
    for name in ("perf_counter", "perf_counter_ns", "time", "monotonic", "process_time"):
        monkeypatch.setattr(time, name, boom)
    for name in ("matmul", "mm"):
        monkeypatch.setattr(torch, name, boom)
    monkeypatch.setattr(torch.Tensor, "__matmul__", boom)
    assert cpu.bf16_matmul_choice() == (True, "avx512_bf16 in /proc/cpuinfo flags")


def test_this_machines_flags_are_read():
    """On Linux x86 the flags line is there and holds the basic ones (fpu on every x86 CPU)."""
    flags = cpu.cpu_flags()
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo on this machine")
    assert "fpu" in flags


@pytest.mark.parametrize(
    "flags,dtype,why",
    [
        (AMX, "bf16", "on this CPU: amx_bf16 in /proc/cpuinfo flags"),
        (AVX512_BF16, "bf16", "on this CPU: avx512_bf16 in /proc/cpuinfo flags"),
        (NO_UNIT, "fp32", "on this CPU: no bf16 matrix unit"),
    ],
)
def test_start_up_notice_says_which_dtype_and_why(monkeypatch, flags, dtype, why):
    """The same notice on every launch (no timings in it): ranks of a machine type print alike."""
    _set_flags(monkeypatch, flags)
    first, second = parse_args(BASE, world_size=1), parse_args(BASE, world_size=1)
    assert first.muon_ns_dtype == second.muon_ns_dtype == dtype
    notices = [n for n in first.notices if n.startswith(setup.NS_DTYPE_NOTICE)]
    assert len(notices) == 1 and notices[0].startswith(f"--muon-ns-dtype not given: Newton-Schulz in {dtype} {why}")
    assert notices == [n for n in second.notices if n.startswith(setup.NS_DTYPE_NOTICE)]


def test_cuda_takes_bf16_whatever_the_cpu(monkeypatch):
    _set_flags(monkeypatch, NO_UNIT)
    monkeypatch.setattr(validate, "_has_cuda", lambda: True)
    args = parse_args(BASE, world_size=1)
    assert args.muon_ns_dtype == "bf16"
    assert any(n == "--muon-ns-dtype not given: Newton-Schulz in bf16 on CUDA" for n in args.notices)


def test_explicit_choices_win_over_the_machine(monkeypatch):
    _set_flags(monkeypatch, NO_UNIT)
    assert parse_args(BASE + ["--muon-ns-dtype", "bf16"], world_size=1).muon_ns_dtype == "bf16"
    args = parse_args(BASE + ["--muon-fp32-matmul-prec", "medium"], world_size=1)
    assert args.muon_ns_dtype == "bf16"
    assert any("from --muon-fp32-matmul-prec medium" in n for n in args.notices)
    _set_flags(monkeypatch, AMX)
    assert parse_args(BASE + ["--muon-fp32-matmul-prec", "high"], world_size=1).muon_ns_dtype == "fp32"


@pytest.mark.parametrize("flags,dtype", [(AVX512_BF16, "bf16"), (NO_UNIT, "fp32")])
def test_checkpoint_args_hold_the_resolved_dtype(monkeypatch, flags, dtype):
    """What a checkpoint saves as its args (checkpoint/state.py) names the dtype the run used."""
    _set_flags(monkeypatch, flags)
    saved = args_dict(parse_args(BASE, world_size=1))
    assert saved["muon_ns_dtype"] == dtype and "notices" not in saved


def test_one_process_makes_no_collective(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a collective with one process")

    _set_flags(monkeypatch, AVX512_BF16)
    args = parse_args(BASE, world_size=1)
    notices = list(args.notices)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(torch.distributed, "all_gather_object", boom)
    setup.agree_ns_dtype(args)
    assert args.muon_ns_dtype == "bf16" and args.notices == notices


SCENARIOS = {  # name -> (rank 0's flags, rank 1's flags, extra command-line flags)
    "differ": (AVX512_BF16, NO_UNIT, []),
    "agree": (AVX512_BF16, AVX512_BF16, []),
    "explicit": (AVX512_BF16, NO_UNIT, ["--muon-ns-dtype", "bf16"]),
}


def _start_up_worker(rank, world_size):
    """Each scenario through the real start-up (training/loop.py initialize_distributed: the
    agreement, then the check that every rank has the same flags)."""
    from megatron_mfsdp.training.loop import initialize_distributed

    saved_flags = cpu.cpu_flags
    out = {}
    try:
        for name, (*flags, extra) in SCENARIOS.items():
            cpu.cpu_flags = lambda flags=flags[rank]: frozenset(flags)
            args = parse_args(BASE + extra, world_size=world_size)
            initialize_distributed(args)
            notices = [n for n in args.notices if n.startswith(setup.NS_DTYPE_NOTICE)]
            out[name] = (args.muon_ns_dtype, notices, args_dict(args)["muon_ns_dtype"])
    finally:
        cpu.cpu_flags = saved_flags
    return out


def test_ranks_agree_on_the_default():
    """Rank 1 lacks the bf16 unit: both ranks iterate in fp32 and say which rank chose what;
    the control where both have it keeps bf16; an explicit dtype is not overruled."""
    first, second = run_workers(2, _start_up_worker)
    assert first == second  # the same dtype, notice and checkpoint args on every rank
    dtype, notices, saved = first["differ"]
    assert dtype == saved == "fp32"
    assert notices == [
        "--muon-ns-dtype not given: Newton-Schulz in fp32 on every rank: the ranks' hardware chose differently "
        "(bf16 on rank(s) 0; fp32 on rank(s) 1)"
    ]
    dtype, notices, saved = first["agree"]
    assert dtype == saved == "bf16"
    assert notices == [
        "--muon-ns-dtype not given: Newton-Schulz in bf16 on this CPU: avx512_bf16 in /proc/cpuinfo flags"
    ]
    assert first["explicit"] == ("bf16", [], "bf16")
