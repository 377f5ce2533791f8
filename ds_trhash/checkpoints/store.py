"""The crash-safe checkpoint store, reading side: manifest, verification, listing, rotation.

A checkpoint directory either exists complete, with a manifest that proves every byte, or
does not exist at all (``save.save_checkpoint`` writes it). A crash at any point leaves at
most a ``*.tmp*`` directory, which listings ignore and rotation removes.

Nothing here imports torch: the commands that only list, verify, upload or prune checkpoints
(``ds-trhash sync`` and each pass of ``sync --watch``, ``cleanup``) start without it.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.state import (
    _STEP_DIR,
    CHECKPOINTS,
    MANIFEST,
    TRAINER_STATE,
    CheckpointError,
    Log,
    read_trainer_state,
)
from ds_trhash.checkpoints.sync_guard import LockHeld, is_verified, output_lock, read_verified
from ds_trhash.io import fsync_path, remove_dir, sha256_file
from ds_trhash.safe_names import UnsafeNameError, relative_path


def _files_under(root: Path) -> dict[str, Path]:
    """Every regular file below root keyed by its POSIX relative path, the manifest excluded."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != MANIFEST:
            found[rel] = path
    return found


def _synced_entries(root: Path, known: Mapping[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file below root (the manifest excluded), each fsynced first;
    those in ``known`` were hashed and fsynced as they were written (their entry is checked
    against the file's size)."""
    entries = {}
    known = known or {}
    present = _files_under(root)
    unlisted = sorted(set(known) - set(present))
    if unlisted:
        raise CheckpointError(f"{', '.join(unlisted)} hashed while written but missing from {root}")
    for rel, path in present.items():
        if rel in known:
            if path.stat().st_size != known[rel]["size"]:
                raise CheckpointError(f"{rel} has {path.stat().st_size} bytes but {known[rel]['size']} were written")
            entries[rel] = {"size": known[rel]["size"], "sha256": known[rel]["sha256"]}
            continue
        fsync_path(path)
        entries[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return entries


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    has_manifest: bool

    @property
    def name(self) -> str:
        return self.path.name

    def __fspath__(self) -> str:
        """Usable wherever a path is: ``read_trainer_state(info)``, ``Path(info)``."""
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def list_checkpoints(output_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Published step directories, oldest first; ``*.tmp*`` directories are never listed."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append(CheckpointInfo(int(match.group(1)), child, (child / MANIFEST).is_file()))
    return sorted(found, key=lambda c: c.step)


def verify(ckpt_dir: str | os.PathLike, *, deep: bool = True) -> tuple[bool, str]:
    """(ok, reason). ``deep=False`` checks presence and sizes only (cheap, for rotation).

    Reasons read after "<name> is ...": they start with "incomplete" or "corrupt".
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        return False, f"incomplete ({ckpt} is not a directory)"
    if not (ckpt / MANIFEST).is_file():
        return False, f"incomplete ({MANIFEST} missing)"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
        listed = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"corrupt ({MANIFEST} unreadable: {exc})"
    if not isinstance(listed, dict) or not all(isinstance(e, dict) for e in listed.values()):
        return False, f"corrupt ({MANIFEST} 'files' is not an object of {{size, sha256}} entries)"
    for rel in listed:
        try:  # names from the manifest stay inside the checkpoint (docs/contracts.md §2d)
            relative_path(rel, str(ckpt / MANIFEST), "files")
        except UnsafeNameError as exc:
            return False, f"corrupt ({exc})"
    present = _files_under(ckpt)
    missing = sorted(set(listed) - set(present))
    extra = sorted(set(present) - set(listed))
    if missing:
        return False, f"corrupt ({', '.join(missing)} listed in {MANIFEST} but missing)"
    if extra:
        return False, f"corrupt ({', '.join(extra)} not listed in {MANIFEST})"
    if TRAINER_STATE not in listed:
        return False, f"incomplete ({TRAINER_STATE} missing)"
    for rel, entry in listed.items():
        size = present[rel].stat().st_size
        if size != entry.get("size"):
            return False, f"corrupt ({rel} has {size} bytes, {MANIFEST} says {entry.get('size')})"
    if deep:
        for rel, entry in listed.items():
            if sha256_file(present[rel]) != entry.get("sha256"):
                return False, f"corrupt ({rel} SHA-256 differs from {MANIFEST})"
    try:
        complete = read_trainer_state(ckpt).get("complete") is True
    except CheckpointError as exc:
        return False, f"corrupt ({exc})"
    if not complete:
        return False, f"incomplete ({TRAINER_STATE} is not marked complete)"
    return True, "ok"

# --------------------------------------------------------------------------- rotation


def rotation_survivors(complete: Iterable[int], keep_last: int, protect: Iterable[int], newest_ok: int) -> set[int]:
    """Steps a rotation keeps among the complete checkpoints ``complete``: the newest
    ``keep_last``, every protected step, and the newest checkpoint that verifies (under
    ``keep_unsynced`` the ones a Hub sync has not verified stay too)."""
    return set(sorted(complete)[-keep_last:]) | set(protect) | {newest_ok}


def rotate(
    output_dir: str | os.PathLike,
    keep_last: int,
    protect: Iterable[int] = (),
    log: Log = print,
    *,
    keep_unsynced: bool = False,
) -> list[Path]:
    """Delete old checkpoints beyond the newest ``keep_last`` and stale ``*.tmp*`` directories.

    Never deleted: the newest checkpoint that verifies (size check), any protected step (pack
    boundaries, epoch ends), any directory without a manifest (left for a person to inspect),
    anything when no checkpoint verifies, and with ``keep_unsynced`` any checkpoint a Hub sync
    has not verified with its current manifest (``sync_guard``). Rank 0 only, after a save has
    returned; the caller holds the output directory's lock (``rotate_unless_syncing``).
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}: the newest checkpoint is always kept")
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for child in sorted(root.iterdir()):
        if ".tmp" in child.name and child.is_dir():
            shutil.rmtree(child)
            log(f"removed stale temporary directory {child.name}")
            removed.append(child)
    listed = list_checkpoints(output_dir)
    newest_ok = next((c for c in reversed(listed) if c.has_manifest and verify(c.path, deep=False)[0]), None)
    if newest_ok is None:
        return removed
    keep = rotation_survivors([c.step for c in listed if c.has_manifest], keep_last, protect, newest_ok.step)
    verified = read_verified(output_dir) if keep_unsynced else {}
    unsynced = []
    for info in listed:
        if not info.has_manifest:
            log(f"left {info.name} in place: it has no {MANIFEST} (incomplete); inspect or delete it by hand")
        elif info.step not in keep and info.step < newest_ok.step:
            if keep_unsynced and not is_verified(verified, f"{CHECKPOINTS}/{info.name}",
                                                 sha256_file(info.path / MANIFEST)):
                unsynced.append(info.name)
                continue
            remove_dir(info.path)
            log(f"rotated out {info.name}")
            removed.append(info.path)
    if unsynced:
        log(f"kept {', '.join(unsynced)}: not yet verified on the Hub by a sync (checkpoint.keep_unsynced)")
    return removed


def rotate_unless_syncing(output_dir: str | os.PathLike, keep_last: int, protect: Iterable[int] = (),
                          log: Log = print, *, keep_unsynced: bool = False) -> list[Path] | None:
    """Rotation as the trainer runs it: under the output directory's sync lock, taken without
    waiting so training never stalls behind an upload. None when a sync holds the lock (nothing
    is deleted; the next checkpoint's rotation catches up)."""
    try:
        with output_lock(output_dir):
            return rotate(output_dir, keep_last, protect, log, keep_unsynced=keep_unsynced)
    except LockHeld:
        log("rotation deferred: a Hub sync holds the output directory's lock (it may be uploading these "
            "checkpoints); the next checkpoint rotates")
        return None


