"""Typed reads of one decoded JSON object, the shared core of the data formats' validation layers.

A manifest or a plan may come from anyone who can write a dataset repository, so every field is
read through one of these methods: a string where a number belongs, a boolean for an integer, a
list that is not a list, a name with a directory part, each becomes one error naming the file
(``origin``), the dotted field (``shards[3].rows``) and the fix, never a traceback later on.
Each format subclasses ``JsonFields`` with its error class and its fix.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import ClassVar, Literal, Optional, overload

from ds_trhash.errors import UserError
from ds_trhash.safe_names import UnsafeNameError, bare_name

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def kind(value: object) -> str:
    """How a JSON value reads in a message."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


class JsonFields:
    """Typed reads of one JSON object; errors name ``origin`` and the dotted field under ``where``."""

    error: ClassVar[type[UserError]] = UserError
    fix: ClassVar[str] = ""

    def __init__(self, doc: object, origin: str, where: str = "") -> None:
        self.origin, self.where = origin, where
        if not isinstance(doc, Mapping):
            raise self.fail("", f"must be a JSON object, got {kind(doc)}")
        self.doc = doc

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where and key else (self.where or key)

    def fail(self, key: str, message: str) -> UserError:
        at = f" field {self.path(key)!r}" if self.path(key) else ""
        return self.error(f"{self.origin}{at} {message}; {self.fix}")

    def has(self, key: str) -> bool:
        return key in self.doc and self.doc[key] is not None

    def value(self, key: str, required: bool) -> object:
        if key not in self.doc:
            if required:
                raise self.fail(key, "is missing")
            return None
        return self.doc[key]

    @overload
    def integer(self, key: str, minimum: int = 0, required: Literal[True] = True) -> int: ...
    @overload
    def integer(self, key: str, minimum: int = 0, *, required: bool) -> Optional[int]: ...
    def integer(self, key: str, minimum: int = 0, required: bool = True) -> Optional[int]:
        value = self.value(key, required)
        if value is None and not required:
            return None
        return self.check_integer(key, value, minimum)

    def check_integer(self, key: str, value: object, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"is {value!r} ({kind(value)}); it must be a JSON integer (not a string or boolean)")
        if value < minimum:
            raise self.fail(key, f"is {value}; it must be >= {minimum}")
        return value

    @overload
    def number(self, key: str, required: Literal[True]) -> float: ...
    @overload
    def number(self, key: str, required: bool = False) -> Optional[float]: ...
    def number(self, key: str, required: bool = False) -> Optional[float]:
        value = self.value(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.fail(key, f"is {value!r} ({kind(value)}); it must be a finite number >= 0")
        return float(value)

    @overload
    def text(self, key: str, required: Literal[True] = True) -> str: ...
    @overload
    def text(self, key: str, required: bool) -> Optional[str]: ...
    def text(self, key: str, required: bool = True) -> Optional[str]:
        value = self.value(key, required)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"is {value!r} ({kind(value)}); it must be a non-empty string")
        return value

    def array(self, key: str) -> list:
        value = self.value(key, True)
        if not isinstance(value, list):
            raise self.fail(key, f"is {kind(value)}; it must be a list")
        return value

    @overload
    def table(self, key: str, required: Literal[True] = True) -> Mapping: ...
    @overload
    def table(self, key: str, required: bool) -> Optional[Mapping]: ...
    def table(self, key: str, required: bool = True) -> Optional[Mapping]:
        value = self.value(key, required)
        if value is None and not required:
            return None
        if not isinstance(value, Mapping):
            raise self.fail(key, f"is {kind(value)}; it must be an object")
        return value

    @overload
    def choice(self, key: str, allowed: tuple[str, ...], required: Literal[True] = True) -> str: ...
    @overload
    def choice(self, key: str, allowed: tuple[str, ...], required: bool) -> Optional[str]: ...
    def choice(self, key: str, allowed: tuple[str, ...], required: bool = True) -> Optional[str]:
        value = self.value(key, required)
        if value is None and not required:
            return None
        if value not in allowed:
            raise self.fail(key, f"is {value!r}; allowed: {', '.join(map(repr, allowed))}")
        return value

    @overload
    def sha256(self, key: str, required: Literal[True] = True) -> str: ...
    @overload
    def sha256(self, key: str, required: bool) -> Optional[str]: ...
    def sha256(self, key: str, required: bool = True) -> Optional[str]:
        value = self.text(key, required)
        if value is not None and not _SHA256.match(value):
            raise self.fail(key, f"is {value!r}; it must be 64 lowercase hexadecimal digits (a SHA-256)")
        return value

    def name(self, key: str) -> str:
        """A bare file or source name (``ds_trhash.safe_names.bare_name``) held by ``key``."""
        return self.check_name(key, self.value(key, True))

    def check_name(self, key: str, value: object) -> str:
        try:
            return bare_name(value, self.origin, self.path(key))
        except UnsafeNameError as exc:
            raise self.error(f"{exc}; {self.fix}") from None
