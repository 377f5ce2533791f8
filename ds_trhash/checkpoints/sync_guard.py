"""What Hub sync and checkpoint rotation agree on, so that neither deletes the other's work.

Both delete checkpoint directories of one output directory (sync prunes what it verified on the
Hub, the trainer rotates old checkpoints out), and a sync reads a checkpoint for minutes while
it uploads. Two things make that safe:

- One lock per output directory, ``<output_dir>/.sync.lock`` (``fcntl.flock``, released by the
  kernel when the holder exits or dies). Sync holds it from discovery to its last prune; the
  trainer's rotation takes it without waiting and, when a sync holds it, rotates later instead.
- ``<output_dir>/sync_verified.json``: the units (``checkpoints/step_<N>``, exports) whose every
  file a sync verified on the Hub, each with the SHA-256 of the manifest it verified. Rotation
  with ``checkpoint.keep_unsynced: true`` deletes only checkpoints listed there with their
  current manifest, so a checkpoint is never lost before it reached the Hub. A missing or
  unreadable record means "nothing verified" (keep everything), never the opposite.

It imports only ``ds_trhash.io``: the trainer (rotation, through ``checkpoints.store``) and the
release package (sync) both use it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ds_trhash.io import write_json_atomic

LOCK_FILE = ".sync.lock"
VERIFIED_FILE = "sync_verified.json"
VERIFIED_FORMAT = "ds-trhash-sync-verified-v1"


class LockHeld(RuntimeError):
    """The output directory's lock is held by another process (a sync or a rotation)."""


@contextlib.contextmanager
def output_lock(directory: str | os.PathLike, timeout: float = 0.0) -> Iterator[Path]:
    """Hold ``<directory>/.sync.lock``; ``timeout`` 0 raises ``LockHeld`` at once when held."""
    path = Path(directory) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise LockHeld(f"{path} is held by another sync or rotation; deletion and upload never run at "
                                   "the same time: wait for it to finish (or pass a lock timeout)") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def read_verified(output_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Unit name -> {"manifest_sha256", "repo_id", ...}; empty when absent or unreadable."""
    try:
        doc = json.loads((Path(output_dir) / VERIFIED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    units = doc.get("units") if isinstance(doc, dict) and doc.get("format") == VERIFIED_FORMAT else None
    if not isinstance(units, dict):
        return {}
    return {name: entry for name, entry in units.items()
            if isinstance(entry, dict) and isinstance(entry.get("manifest_sha256"), str)}


def is_verified(verified: Mapping[str, Mapping[str, Any]], unit: str, manifest_sha256: str | None) -> bool:
    """Whether ``unit`` was verified on the Hub with exactly this manifest (a directory re-created
    under the same name by a later run is not)."""
    entry = verified.get(unit)
    return manifest_sha256 is not None and entry is not None and entry.get("manifest_sha256") == manifest_sha256


def update_verified(output_dir: str | os.PathLike, *, add: Mapping[str, Mapping[str, Any]] = {},
                    remove: tuple[str, ...] = ()) -> None:
    """Add or drop units in the record (atomically: temp file, fsync, rename). The caller holds
    ``output_lock``."""
    path = Path(output_dir) / VERIFIED_FILE
    units = read_verified(output_dir)
    units.update({name: dict(entry) for name, entry in add.items()})
    for name in remove:
        units.pop(name, None)
    write_json_atomic(path, {"format": VERIFIED_FORMAT, "units": dict(sorted(units.items()))})
