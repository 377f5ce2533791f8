"""What every config section is made of: its one error type, the value checks and the field helper.

A component declares its own config section next to its code (the data's in ``data/stage/``, LoRA's
in ``model/lora.py``, ...), and ``training/config`` composes them into ``TrainConfig``. The
sections need the same few pieces, so they live here, below every package: ``ConfigError``, the
checks a field carries (each returns a problem string, or None when the value is acceptable) and
``setting`` (a dataclass field with its check in its metadata; the reader in
``training/config/reading.py`` runs it once the value's type is right, so a range problem is
reported with the file and dotted key like any other). Imports nothing of ours but ``errors``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, field
from typing import Any, TypeVar, overload

from ds_trhash.errors import UserError

Check = Callable[[Any], "str | None"]
T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A configuration that must not be launched; the message is meant for the user as is."""

    def __init__(self, source: str, key: str, problem: str):
        self.source = source
        self.key = key
        self.problem = problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


def positive(v: float) -> str | None:
    return None if v > 0 else f"must be > 0, got {v!r}"


def non_negative(v: float) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v!r}"


def half_open_unit(v: float) -> str | None:
    return None if 0 <= v < 1 else f"must be in [0, 1), got {v!r}"


def closed_unit(v: float) -> str | None:
    return None if 0 <= v <= 1 else f"must be in [0, 1], got {v!r}"


def optional(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


@overload
def setting(default: T, *, check: Callable[[T], str | None] | None = None) -> T: ...
@overload
def setting(*, factory: Callable[[], T], check: Callable[[T], str | None] | None = None) -> T: ...
def setting(default: object = MISSING, *, check: Check | None = None,
            factory: Callable[[], object] | None = None) -> object:
    """A section's field: its default (or ``factory``) and the ``check`` its value must pass."""
    meta = {"check": check} if check else {}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)
