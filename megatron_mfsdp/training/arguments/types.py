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


def layer_pattern(text: str) -> int | list[int]:
    """--moe-layer-freq: an integer N (one MoE layer every N layers), or a list expression of 0s and 1s
    such as ``([0]+[1]*23)`` or ``([1]*3+[0]*2)*2`` (Megatron-LM's moe_freq_type evaluates these with
    ``eval`` after a character check; here a parse of list literals, ``+`` and ``*`` only)."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(node)

    text = text.strip()
    try:
        if "[" not in text:
            number = int(text)
            if number <= 0:
                raise ValueError(number)
            return number
        pattern = value(ast.parse(text, mode="eval").body)
        if not isinstance(pattern, list) or not pattern or any(v not in (0, 1) for v in pattern):
            raise ValueError(pattern)
        return pattern
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or a list expression of 0s and 1s such as ([0]+[1]*3), got {text!r}"
        ) from None
