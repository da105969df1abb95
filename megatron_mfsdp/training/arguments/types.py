"""argparse value types that reject bad numbers at parse time, so every error names its
flag (argparse prefixes it) and exits 2 before any process group, model or dataset exists."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    value = _number(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def probability(text: str) -> float:
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def fraction(text: str) -> float:
    """A share in (0, 1], such as --rotary-percent (0 would leave nothing to rotate)."""
    value = finite_float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def attention_backend(text: str) -> str:
    """megatron-core's AttnBackend names (flash, fused, unfused, local, auto); Megatron-LM
    passes an enum, we keep the name and build the enum where megatron-core needs it."""
    names = ("flash", "fused", "unfused", "local", "auto")
    name = text.split(".")[-1]
    if name not in names:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(names)}, got {text!r}")
    return name


def signal_name(text: str) -> str:
    """A signal by name (SIGTERM) or number (15), as Megatron-LM's --exit-signal takes signal.Signals; kept
    as its name (the flags are compared across ranks as JSON)."""
    import signal

    try:
        return signal.Signals(int(text)).name if text.isdigit() else signal.Signals[text].name
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a signal: {text!r} (e.g. SIGTERM, SIGUSR1 or a number)") from None
