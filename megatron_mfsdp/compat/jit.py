"""megatron-core's fusions, compiled at their first call instead of at import.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when imported, and importing
megatron.core decorates some 24 fusions (bias-GeLU, bias-SwiGLU, ...) with it. Decorating
resolves the inductor backend, which imports inductor: seconds of CPU in every process that
imports megatron.core, before any flag is parsed (benchmarks/results/startup.md). A machine that
starts dozens of ranks, tools and tests pays it each time, and a run with
``--disable-jit-fuser`` never compiles a fusion at all.

Importing this module (megatron_mfsdp's first import) calls :func:`import_megatron_core`,
which puts :func:`deferred_compile` in ``torch.compile``'s place while megatron.core is
imported, so ``jit_fuser`` becomes it; ``torch.compile`` itself is restored at once. A
deferred function calls ``torch.compile(fn, **options)`` at its first call, so compilation
(lazy in torch anyway) and its results are what they were; if by then
``megatron.core.jit.disable_jit_fuser`` has run (``--disable-jit-fuser``), the function runs
eagerly and inductor is never imported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch


def deferred_compile(fn: Callable | None = None, **options):
    """``torch.compile(fn, **options)``, built at the first call (see the module docstring)."""
    if fn is None:
        return functools.partial(deferred_compile, **options)
    built: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not built:
            built.append(fn if _jit_disabled() else _COMPILE(fn, **options))
        return built[0](*args, **kwargs)

    return call


def _jit_disabled() -> bool:
    from megatron.core import jit

    return jit.jit_fuser is jit.noop_decorator


_COMPILE = torch.compile


def import_megatron_core() -> None:
    """Import megatron.core with :func:`deferred_compile` in ``torch.compile``'s place (see
    the module docstring); nothing if it is already imported (its fusions are decorated)."""
    if "megatron.core" in sys.modules:
        return
    torch.compile = deferred_compile
    try:
        import megatron.core  # noqa: F401  (sets jit_fuser and decorates the fusions now)
    finally:
        torch.compile = _COMPILE


import_megatron_core()
