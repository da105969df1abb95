"""megatron-core's fusions compile at their first call, not at import (compat/jit.py)."""

import subprocess
import sys

import torch

from tests.launch import ROOT


def test_importing_megatron_mfsdp_leaves_inductor_unimported():
    """megatron.core alone imports inductor (torch.compile resolves its backend when it decorates
    the fusions); through megatron_mfsdp, jit_fuser is the deferred compile and inductor waits."""
    probe = "import sys, {0}; import megatron.core.jit as j; print(j.jit_fuser.__name__, '{1}' in sys.modules)"

    def run(module):
        code = probe.format(module, "torch._inductor.compile_fx")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert run("megatron_mfsdp") == ["deferred_compile", "False"]
    assert run("megatron.core") == ["compile", "True"]  # the control: what the deferral saves


def test_deferred_compile_compiles_once_at_first_call_or_runs_eagerly_when_disabled(monkeypatch):
    from megatron.core import jit

    from megatron_mfsdp.compat import jit as deferred

    built = []

    def fake_compile(fn, **options):
        built.append(options)
        return lambda *a, **k: fn(*a, **k) + 1  # marks results that went through the "compiled" one

    monkeypatch.setattr(deferred, "_COMPILE", fake_compile)
    monkeypatch.setattr(jit, "jit_fuser", deferred.deferred_compile)
    twice = deferred.deferred_compile(lambda t: t * 2, dynamic=False)
    assert built == []
    assert twice(torch.ones(1)).item() == 3 and twice(torch.ones(1)).item() == 3
    assert built == [{"dynamic": False}]  # built once, with the decorator's options
    assert deferred.deferred_compile(dynamic=True)(lambda t: t)(torch.zeros(1)).item() == 1

    monkeypatch.setattr(jit, "jit_fuser", jit.noop_decorator)  # what --disable-jit-fuser does
    eager = deferred.deferred_compile(lambda t: t * 2)
    assert eager(torch.ones(1)).item() == 2 and len(built) == 2
