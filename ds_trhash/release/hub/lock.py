"""The output directory's lock and verified record as ``sync`` uses them.

``sync`` holds the lock (``<output_dir>/.sync.lock``, shared with the trainer's rotation through
``checkpoints.sync_guard``) for discovery, upload, remote verification and pruning, so deletion
and upload never race; it records every unit verified on the Hub in ``sync_verified.json``,
which rotation with ``checkpoint.keep_unsynced``, cleanup and the watcher read. This module
exists so that the one place deciding which directory's lock guards a unit, and what a record
must hold to be trusted, is shared by the one-shot sync and the watcher (docs/contracts.md §9).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints import CHECKPOINTS, MANIFEST
from ds_trhash.checkpoints.sync_guard import LockHeld, output_lock, update_verified
from ds_trhash.io import sha256_file
from ds_trhash.release.export.manifest import EXPORT_MANIFEST
from ds_trhash.release.hub.client import SyncError
from ds_trhash.release.hub.units import Unit, is_checkpoint_dir, is_export_dir


@contextlib.contextmanager
def sync_lock(directory: str | os.PathLike, timeout: float = 0.0) -> Iterator[Path]:
    """The output directory's lock (``checkpoints.sync_guard.output_lock``), which the trainer's
    rotation takes too; ``timeout`` 0 fails at once when held."""
    try:
        with output_lock(directory, timeout) as path:
            yield path
    except LockHeld as exc:
        raise SyncError(str(exc)) from None


def discover_lock_dir(root: Path) -> Path:
    """The output directory whose lock guards ``root`` (the same for a run, its checkpoints and
    its exports)."""

    if root.is_dir() and is_checkpoint_dir(root):
        return root.parent.parent if root.parent.name == CHECKPOINTS else root.parent
    if root.is_dir() and is_export_dir(root):
        return root.parent.parent if root.parent.name == "exports" else root.parent
    return root


def recorded_as_verified(records: Mapping[str, Mapping[str, Any]], name: str, manifest: Path, repo_id: str,
                         prefix: str) -> bool:
    """Whether ``sync_verified.json`` (``records``) says unit ``name`` is on ``repo_id`` under
    ``prefix`` with exactly the manifest it has now."""
    entry = records.get(name)
    return (entry is not None and entry.get("repo_id") == repo_id and entry.get("prefix", "") == prefix
            and manifest.is_file() and entry.get("manifest_sha256") == sha256_file(manifest))


def mark_verified(lock_dir: Path, unit: Unit, repo_id: str) -> None:
    """Tell the trainer's rotation (``checkpoint.keep_unsynced``), cleanup and the watcher that
    this unit is on the Hub, with exactly this manifest (and where: repository and prefix)."""
    manifest = MANIFEST if unit.kind == "checkpoint" else EXPORT_MANIFEST
    entry = {"manifest_sha256": unit.files[manifest]["sha256"], "repo_id": repo_id}
    if unit.prefix:
        entry["prefix"] = unit.prefix
    update_verified(lock_dir, add={unit.name: entry})
