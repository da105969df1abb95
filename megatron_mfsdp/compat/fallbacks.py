"""megatron-core's CPU fallback warnings, told once in one line by the command-line tools.

Without Transformer Engine or Apex, importing megatron-core warns once per module that it falls
back (``UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch
optimizers.``, and five more such), and loading a checkpoint adds deprecation warnings of
megatron-core's and torch's own internals: 18 lines of stderr before ``tools/generate.py``'s
answer, none of which its user can act on. A tool records the warnings of its run and hands
them to :func:`report`::

    with warnings.catch_warnings(record=not sys.warnoptions) as caught:
        try:
            return run(args)
        finally:
            from megatron_mfsdp.compat.fallbacks import report  # imported inside: it imports megatron.core

            report(caught, "generate.py")

which prints, on rank 0 only, one line in the form of pretrain_gpt.py's start-up notices::

    > notice: generate.py: Transformer Engine and Apex are not installed: megatron-core runs Torch
    optimizers and local multi_tensor_applier, multi_tensor_l2norm and multi_tensor_scale instead;
    Apex is not installed: megatron-core runs Torch Norm instead (9 warnings, 3 of them deprecations
    inside the libraries; -W default shows them)

Any other warning is shown as Python would have shown it. ``-W`` or ``PYTHONWARNINGS`` (anything
in ``sys.warnoptions``) means the user chose: nothing is recorded (``record=False`` gives None)
and every warning goes through Python's own filters, as before.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Iterable

FALLBACK = re.compile(r"^(?P<missing>.+?) (?:is|are) not installed\. Falling back to (?P<instead>.+?)\.?$")
"""megatron-core's wording (core_v0.16.1: megatron/core/optimizer/__init__.py, models/backends.py, ...)."""
_LOCAL = "local implementations of "
_DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def fallback(message) -> tuple[str, list[str]] | None:
    """(what is missing, the things that run instead) of a fallback warning; None for another one.
    "local implementations of a, b, and c" gives ["local a", "local b", "local c"]."""
    match = FALLBACK.match(str(message))
    if match is None:
        return None
    instead = match["instead"]
    if not instead.startswith(_LOCAL):
        return match["missing"], [instead]
    names = re.split(r",\s*(?:and\s+)?|\s+and\s+", instead[len(_LOCAL) :])
    return match["missing"], [f"local {name.strip()}" for name in names if name.strip()]


def is_deprecation(warning) -> bool:
    """A deprecation raised inside the libraries (a FutureWarning too: megatron-core calls torch's
    deprecated names, and keeps its own for old configurations)."""
    return issubclass(warning.category, _DEPRECATIONS) or "deprecated" in str(warning.message)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def fallback_line(messages: Iterable) -> str | None:
    """The line "<missing> (is|are) not installed: megatron-core runs <what> instead; ..." over the fallback
    messages given (others skipped), each thing named once; None if none."""
    instead: dict[str, list[str]] = {}
    for message in messages:
        parsed = fallback(message)
        if parsed is not None:
            things = instead.setdefault(parsed[0], [])
            things += [thing for thing in parsed[1] if thing not in things]
    if not instead:
        return None
    parts = []
    for missing, things in instead.items():
        local = sorted(t for t in things if t.startswith("local "))
        named = [t for t in things if t not in local] + ([_join(local).replace(" local ", " ")] if local else [])
        verb = "are" if " and " in missing else "is"
        parts.append(f"{missing} {verb} not installed: megatron-core runs {_join(named)} instead")
    return "; ".join(parts)


def report(caught: list | None, prog: str, stream=None) -> None:
    """After a run under ``warnings.catch_warnings(record=...)``: the fallback warnings as one
    ``> notice:`` line (rank 0 of a torchrun job only, as the run's other lines), the libraries'
    deprecations counted in it, every other warning written as Python writes it. None (``-W`` or
    ``PYTHONWARNINGS`` given): nothing to do, Python has shown what its filters let through."""
    if caught is None:
        return
    stream = sys.stderr if stream is None else stream
    quiet = [w for w in caught if fallback(w.message) is not None or is_deprecation(w)]
    for w in caught:
        if w not in quiet:
            stream.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    line = fallback_line(w.message for w in quiet)
    deprecations = sum(1 for w in quiet if fallback(w.message) is None)
    if not quiet or os.environ.get("RANK", "0") != "0":
        return
    if line is None:
        line = "megatron-core and torch warned of deprecations inside them"
    tail = f", {deprecations} of them deprecations inside the libraries" if deprecations else ""
    stream.write(f"> notice: {prog}: {line} ({len(quiet)} warnings{tail}; -W default shows them)\n")
    stream.flush()
