"""The Newton-Schulz dtype default by this machine's capability (issue 11, item 9): AMX-BF16
in /proc/cpuinfo decides without timing, flags without a bf16 unit choose fp32, and only
in between (or without flags) a timed probe decides; the start-up notice says which and why."""

import pytest

from megatron_mfsdp.compat import cpu
from megatron_mfsdp.training.arguments import parse_args
from tests.launch import TINY


def _no_probe():
    raise AssertionError("the probe ran although the flags decide")


@pytest.fixture
def machine(monkeypatch):
    """Set the CPU flags (None: no flags line) and the probe's (bf16 ms, fp32 ms), or no probe."""

    def set_machine(flags, probe=None):
        monkeypatch.setattr(cpu, "cpu_flags", lambda: None if flags is None else frozenset(flags))
        monkeypatch.setattr(cpu, "bf16_matmul_probe", (lambda: probe) if probe else _no_probe)

    return set_machine


@pytest.mark.parametrize(
    "flags,probe,fast,reason",
    [
        (["fpu", "avx512_bf16", "amx_bf16", "amx_tile"], None, True, "AMX-BF16 (amx_bf16 in /proc/cpuinfo flags)"),
        (["fpu", "avx2", "avx512f"], None, False, "no bf16 matrix unit"),
        (["avx512_bf16"], (1.0, 4.0), True, "avx512_bf16 without amx_bf16 in /proc/cpuinfo flags; timed probe"),
        (["avx512_bf16"], (3.5, 4.0), False, "timed probe: bf16 3.50 ms, fp32 4.00 ms"),  # under 0.8x or fp32
        (None, (1.0, 7.0), True, "no /proc/cpuinfo flags; timed probe: bf16 1.00 ms, fp32 7.00 ms"),
        (None, (50.0, 1.0), False, "no /proc/cpuinfo flags"),
    ],
)
def test_choice_prefers_flags_over_the_probe(machine, flags, probe, fast, reason):
    machine(flags, probe)
    chosen, why = cpu.bf16_matmul_choice()
    assert chosen is fast and reason in why


def test_this_machines_flags_are_read():
    """On Linux x86 the flags line is there and holds the basic ones (fpu on every x86 CPU)."""
    flags = cpu.cpu_flags()
    if flags is None:
        pytest.skip("no flags line in /proc/cpuinfo on this machine")
    assert "fpu" in flags


def test_probe_times_both_dtypes():
    bf16, fp32 = cpu.bf16_matmul_probe(size=32, repeats=1)
    assert bf16 > 0 and fp32 > 0


_PIN = TINY.index("--muon-ns-dtype")
BASE = TINY[:_PIN] + TINY[_PIN + 2 :]  # the tiny run's flags without its pinned NS dtype


@pytest.mark.parametrize(
    "flags,dtype,why",
    [
        (["amx_bf16"], "bf16", "on this CPU: AMX-BF16 (amx_bf16 in /proc/cpuinfo flags)"),
        (["avx2"], "fp32", "on this CPU: no bf16 matrix unit"),
    ],
)
def test_start_up_notice_says_which_dtype_and_why(machine, flags, dtype, why):
    machine(flags)
    args = parse_args(BASE, world_size=1)
    assert args.muon_ns_dtype == dtype
    assert any(n.startswith(f"--muon-ns-dtype not given: Newton-Schulz in {dtype} {why}") for n in args.notices)


def test_explicit_choices_win_over_the_machine(machine):
    machine(["avx2"])
    assert parse_args(BASE + ["--muon-ns-dtype", "bf16"], world_size=1).muon_ns_dtype == "bf16"
    args = parse_args(BASE + ["--muon-fp32-matmul-prec", "medium"], world_size=1)
    assert args.muon_ns_dtype == "bf16"
    assert any("from --muon-fp32-matmul-prec medium" in n for n in args.notices)
