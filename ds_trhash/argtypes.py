"""Argument types for the command lines: a value that cannot be meant is refused by argparse.

Each function is an argparse ``type=``: it turns the text into the value or raises
``argparse.ArgumentTypeError`` with what was wrong and what is accepted, so ``--nproc 0``,
``--temperature nan`` or ``--seed 10**30`` end as one usage line (exit 2), never a traceback deep
in the command. Standard library only.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, TypeVar

T = TypeVar("T", int, float)

SEED_MAX = 2**64 - 1  # torch.manual_seed takes a 64-bit seed


def _number(text: str, kind: Callable[[str], T], what: str) -> T:
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (process counts, step counts)."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (limits where 0 means "never")."""
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def seed(text: str) -> int:
    """A random seed torch accepts: an integer in [0, 2**64 - 1]."""
    value = _number(text, int, "an integer")
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1, got {text}")
    return value


def finite_float(text: str) -> float:
    """A finite number (not nan, not inf)."""
    value = _number(text, float, "a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (timeouts, temperatures)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (durations that must allow some time)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
