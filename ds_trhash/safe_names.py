"""Names read from untrusted files stay inside their folder (docs/contracts.md §2d).

Plans, shard manifests, SFT manifests, checkpoint manifests and Hub listings name files that we
then open, copy, replace or delete. Anyone who can write such a file (a dataset repository on the
Hub, a shared disk) must not be able to point us at ``../../../victim.bin``, ``/etc/passwd`` or a
symlink that leads out of the folder. Each check runs where the name is read, before any file is
opened, and its error names the file the name came from and the field that held it.

This module is the one validator of such names (every format and the node cache call it, so a
name accepted at launch is never refused hours later by the cache), and imports nothing of ours
but the error base, so every package may call it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

from ds_trhash.errors import UserError


class UnsafeNameError(UserError, ValueError):
    """A name read from a file would leave its folder (or is not a name at all)."""


# Every part of a name: letters, digits, '_', '-', '.', not a leading '.' (no hidden files, no
# spaces or shell-special characters in the folders we create from it).
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# Endings the node's shard cache keeps for its own files beside an entry (data/stream/cache/files.py):
# a shard of such a name would collide with them (".pin": the hold files of earlier versions, still
# found in old cache directories and skipped like the others).
RESERVED_ENDINGS = (".verified.json", ".lock", ".hold", ".pin")
RESERVED_INFIX = ".partial-"


def _check_part(part: str, text: str, where: str) -> None:
    if not _PART.match(part):
        raise UnsafeNameError(f"{where} is {text!r}: names may hold letters, digits, '_', '-' and '.', and may not "
                              "start with '.'")
    if part.endswith(RESERVED_ENDINGS) or RESERVED_INFIX in part:
        raise UnsafeNameError(f"{where} is {text!r}: a name may not end in {', '.join(RESERVED_ENDINGS)} or hold "
                              f"{RESERVED_INFIX!r} (the shard cache's own files)")


def _where(origin: str, field: str) -> str:
    return f"{origin} field {field!r}" if field else origin


def _common(name: object, origin: str, field: str) -> str:
    where = _where(origin, field)
    if not isinstance(name, str):
        raise UnsafeNameError(f"{where} must be a string naming a file, got {type(name).__name__} {name!r}")
    if not name or not name.strip():
        raise UnsafeNameError(f"{where} is empty; it must name a file inside its folder")
    if "\x00" in name:
        raise UnsafeNameError(f"{where} holds a NUL character ({name!r}); a file name cannot")
    if "\\" in name:
        raise UnsafeNameError(f"{where} is {name!r}: a backslash is not allowed in a name (use '/' where the "
                              "format allows folders)")
    if name.startswith("/") or PurePosixPath(name).is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise UnsafeNameError(f"{where} is the absolute path {name!r}; it must be relative to its folder")
    return name


def bare_name(name: object, origin: str, field: str = "") -> str:
    """A plain file or source name: no directory part, not ``.`` or ``..``, not absolute, no NUL,
    not empty. Returns the name unchanged."""
    text = _common(name, origin, field)
    if "/" in text:
        raise UnsafeNameError(f"{_where(origin, field)} is {text!r}: it must be a bare name without a directory "
                              "part (no '/')")
    if text in (".", ".."):
        raise UnsafeNameError(f"{_where(origin, field)} is {text!r}, which names a folder, not a file inside it")
    _check_part(text, text, _where(origin, field))
    return text


def relative_path(name: object, origin: str, field: str = "") -> str:
    """A relative path where the format allows folders: no ``..`` part, not absolute, no NUL, not
    empty, no empty or ``.`` parts. Returns the path unchanged."""
    text = _common(name, origin, field)
    parts = text.split("/")
    if any(part == ".." for part in parts):
        raise UnsafeNameError(f"{_where(origin, field)} is {text!r}: a '..' part would leave its folder")
    if any(part in ("", ".") for part in parts):
        raise UnsafeNameError(f"{_where(origin, field)} is {text!r}: empty or '.' parts are not allowed; write "
                              "the path plainly (a/b/c)")
    for part in parts:
        _check_part(part, text, _where(origin, field))
    return text


def resolve_under(root: str | os.PathLike, name: str, origin: str, field: str = "") -> Path:
    """``root / name`` after checking ``name`` as a relative path, with every symlink on the way
    resolved: a result outside ``root`` (a symlink leading out) is refused. The file need not
    exist; a missing one is the caller's to report."""
    relative_path(name, origin, field)
    base = Path(root).resolve()
    target = (base / name).resolve()
    if target != base and base not in target.parents:
        raise UnsafeNameError(f"{_where(origin, field)} is {name!r}, which resolves to {target} through a symlink, "
                              f"outside {base}; replace the link with the file itself")
    return Path(root) / name
