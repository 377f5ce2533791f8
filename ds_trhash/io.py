"""Files that are either whole or absent: hashing, fsync, atomic JSON and directory publishing.

Every part of the project that writes something a later run trusts (checkpoints, exports, data
sets, shard manifests, selection records, metrics) uses these helpers, so the rules live in one
place:

* a file is hashed in chunks (a multi-GB weight file never sits in memory);
* a new file or directory survives power loss only once its bytes *and* the directory holding
  its entry are fsynced;
* a JSON document or a directory appears under its final name by one ``os.replace`` /
  ``os.rename`` of a finished temporary, so a reader sees the old version or the new one, never
  a torn one.

Nothing here knows about checkpoints or models; it imports only the standard library.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

PathLike = str | os.PathLike
HASH_CHUNK = 1 << 22  # 4 MiB: large enough to stream at disk speed, small enough to never matter


class os_errors_as(contextlib.ContextDecorator):
    """An ``OSError`` about a path (it names a file: missing, unreadable, unwritable, a file where
    a folder belongs) becomes ``error`` with the operating system's own message, so the one
    error handler of the command line prints it as a line; an OSError naming no file (a bug, a
    broken socket) keeps its traceback. A decorator for a command's handler, or a ``with``."""

    def __init__(self, error: type[Exception]):
        self.error = error

    def __enter__(self) -> "os_errors_as":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if isinstance(exc, OSError) and exc.filename is not None:
            raise self.error(str(exc)) from exc
        return False


def sha256_file(path: PathLike, chunk_bytes: int = HASH_CHUNK) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _not_utf8(path: PathLike, line_no: int, line: bytes, exc: UnicodeDecodeError, error: type[Exception]) -> Exception:
    return error(f"{path}: line {line_no} is not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1}); "
                 "re-encode the file as UTF-8")


def utf8_lines(path: PathLike, error: type[Exception] = ValueError) -> Generator[str, None, None]:
    """The lines of a UTF-8 text file, newlines kept, read one at a time (a file of any size); a
    line that is not UTF-8 raises ``error`` naming the file, the line and the byte."""
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, line_no, raw, exc, error) from None


def read_utf8(path: PathLike, error: type[Exception] = ValueError) -> str:
    """The whole text of a UTF-8 file; a byte that is not UTF-8 raises ``error`` naming its line."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        start = data.rfind(b"\n", 0, exc.start) + 1
        line = data[start:data.find(b"\n", exc.start) if b"\n" in data[exc.start:] else len(data)]
        exc.start -= start
        raise _not_utf8(path, data.count(b"\n", 0, start) + 1, line, exc, error) from None


def fsync_path(path: PathLike) -> None:
    """Flush a file's bytes, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: PathLike) -> None:
    """Every directory below root, deepest first, then root itself: their entries survive power loss."""
    root = Path(root)
    for sub in sorted({p.parent for p in root.rglob("*")} | {root}, key=lambda p: len(p.parts), reverse=True):
        fsync_path(sub)


def json_text(doc: object, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    """The project's JSON file layout: indented, one trailing newline."""
    return json.dumps(doc, indent=indent, sort_keys=sort_keys) + "\n"


def read_json_object(path: PathLike, error: type[Exception] = ValueError, *,
                     missing: str | None = None) -> dict[str, Any]:
    """The JSON object in ``path``; ``error(message naming the file)`` when the text is not JSON or
    not an object. A missing file raises FileNotFoundError, or ``error("<path> is missing; " +
    missing)`` when ``missing`` says what its absence means."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing is None:
            raise
        raise error(f"{path} is missing; {missing}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise error(f"{path} does not hold a JSON object")
    return doc


def write_json(path: PathLike, doc: Mapping[str, Any] | Any, *, sort_keys: bool = True, fsync: bool = True,
               indent: int | None = 2) -> None:
    """Write ``doc`` to ``path`` in place (for files inside a temporary directory that is published
    as a whole); fsynced unless ``fsync=False``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json_text(doc, indent=indent, sort_keys=sort_keys))
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())


def write_text_atomic(path: PathLike, text: str, *, mode: int | None = None, fsync: bool = True) -> None:
    """Replace ``path`` with ``text`` in one step: written beside it under a per-process temporary
    name, fsynced, then renamed over it. A crash leaves the old file (or none), never half a file.

    ``mode`` (e.g. 0o600 for a file only its owner may read) is given to the temporary when it is
    created, so the content is never readable by others, not even before the rename; None keeps
    the usual permissions (0o666 less the umask)."""
    out = Path(path)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)  # the mode given to os.open is filtered by the umask
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_path(out.parent)


def write_json_atomic(path: PathLike, doc: Mapping[str, Any] | Any, *, sort_keys: bool = False,
                      fsync: bool = True, indent: int | None = 2) -> None:
    """``doc`` in the project's JSON layout, replacing ``path`` in one step (write_text_atomic)."""
    write_text_atomic(path, json_text(doc, indent=indent, sort_keys=sort_keys), fsync=fsync)


def publish_dir(tmp: PathLike, final: PathLike, *, replace: bool = True, fsync: bool = True) -> None:
    """Make the finished directory ``tmp`` appear as ``final`` in one rename.

    ``replace=True``: an existing ``final`` is first renamed aside (``<final>.tmp-replaced``),
    then the new one renamed in, then the old copy deleted, so ``final`` names a complete
    directory at every moment except between the two renames. ``replace=False``: a non-empty
    ``final`` makes the rename fail (``OSError``) and nothing is replaced.
    """
    tmp, final = Path(tmp), Path(final)
    if replace and final.exists():
        aside = final.with_name(final.name + ".tmp-replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    if fsync:
        fsync_path(final.parent)


def remove_dir(path: PathLike) -> None:
    """Delete a published directory: renamed to ``<name>.tmp-deleting`` first, so that a crash
    half-way through never leaves a partial directory under a name a listing trusts."""
    path = Path(path)
    doomed = path.with_name(path.name + ".tmp-deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed)
