"""What ``sync`` uploads and whether the Hub already holds it: the complete units of a run
directory (a checkpoint that passes ``checkpoint.verify``, an export that passes
``verify_export``), each with the files its manifest vouches for, and the file-by-file comparison
of a unit with its folder on the Hub (docs/contracts.md §9).

It exists apart from ``sync`` so that the planning and the remote verification, which decide what
is uploaded and what may be pruned, can be read and tested without the upload loop around them.
Remote checks: LFS files by their SHA-256 (``RepoFile.lfs.sha256``), regular git files by their
git blob id (SHA-1 of ``"blob <size>\\0" + bytes``), both from ``HfApi.list_repo_tree``.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_trhash.checkpoints import CHECKPOINTS, ENGINE_TAG, MANIFEST, TRAINER_STATE, list_checkpoints, verify
from ds_trhash.io import sha256_file
from ds_trhash.release.export.manifest import (EXPORT_MANIFEST, WEIGHTS, export_files, read_export_manifest,
                                               verify_export)
from ds_trhash.release.hub.client import SyncError, call_hub

if TYPE_CHECKING:
    from huggingface_hub import HfApi


@dataclass
class Unit:
    """One complete checkpoint or export: the files its manifest vouches for."""

    kind: str  # "checkpoint" | "export"
    path: Path
    path_in_repo: str  # "" = repository root
    files: dict[str, dict[str, Any]]  # relative path -> {"sha256", "size"}
    step: int | None = None
    prefix: str = ""  # --path-in-repo: the folder of the repository that mirrors the run

    @property
    def name(self) -> str:
        """The unit's name in the run directory (and in sync_verified.json), whatever the prefix."""
        return self.path_in_repo or self.path.name

    @property
    def folder(self) -> str:
        """The unit's folder in the repository ("" = the root)."""
        return "/".join(p for p in (self.prefix, self.path_in_repo) if p)

    def remote(self, rel: str) -> str:
        return f"{self.folder}/{rel}" if self.folder else rel


def _checkpoint_unit(path: Path, path_in_repo: str) -> Unit | str:
    ok, reason = verify(path, deep=True)
    if not ok:
        return reason
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    files = {rel: {"sha256": e["sha256"], "size": e["size"]} for rel, e in manifest["files"].items()}
    manifest_path = path / MANIFEST
    files[MANIFEST] = {"sha256": sha256_file(manifest_path), "size": manifest_path.stat().st_size}
    return Unit("checkpoint", path, path_in_repo, files, step=int(manifest.get("step", -1)))


def _export_unit(path: Path, path_in_repo: str) -> Unit | str:
    ok, reason = verify_export(path, deep=True)
    if not ok:
        return reason
    files = dict(export_files(read_export_manifest(path)))
    manifest_path = path / EXPORT_MANIFEST
    files[EXPORT_MANIFEST] = {"sha256": sha256_file(manifest_path), "size": manifest_path.stat().st_size}
    return Unit("export", path, path_in_repo, files)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` is (or was meant to be) a checkpoint directory."""
    return any((path / n).exists() for n in (MANIFEST, TRAINER_STATE, ENGINE_TAG))


def is_export_dir(path: Path) -> bool:
    """Whether ``path`` is (or was meant to be) an export directory."""
    return (path / EXPORT_MANIFEST).is_file() or (path / WEIGHTS).is_file()


@dataclass
class _Plan:
    units: list[Unit]
    skipped: dict[str, str]
    prunable: bool  # an output directory (not a single unit) was given
    complete_steps: list[int]
    recorded: list[str] = field(default_factory=list)  # verified by an earlier sync: left alone


def discover(local_dir: str | os.PathLike, known: Callable[[str, Path], bool] | None = None) -> _Plan:
    """What ``local_dir`` holds: a run output directory, one checkpoint, or one export.
    ``known(name, manifest)``: units of a run directory for which it is true are not hashed
    again but listed in ``recorded`` (``sync(incremental=True)``)."""

    root = Path(local_dir)
    if not root.is_dir():
        raise SyncError(f"{root} is not a directory")
    if is_checkpoint_dir(root):
        unit = _checkpoint_unit(root, f"{CHECKPOINTS}/{root.name}")
        if isinstance(unit, str):
            raise SyncError(f"{root} is {unit}; only complete checkpoints are uploaded")
        return _Plan([unit], {}, False, [])
    if is_export_dir(root):
        unit = _export_unit(root, "")
        if isinstance(unit, str):
            raise SyncError(f"{root} is {unit}; only complete exports are uploaded")
        return _Plan([unit], {}, False, [])
    units: list[Unit] = []
    skipped: dict[str, str] = {}
    complete_steps = []
    recorded: list[str] = []
    for info in list_checkpoints(root):
        rel = f"{CHECKPOINTS}/{info.name}"
        if known is not None and known(rel, info.path / MANIFEST):
            recorded.append(rel)
            continue
        unit = _checkpoint_unit(info.path, rel)
        if isinstance(unit, str):
            skipped[rel] = unit
        else:
            units.append(unit)
            complete_steps.append(info.step)
    candidates = [p for p in sorted(root.iterdir()) if p.is_dir()]
    if (root / "exports").is_dir():
        candidates += [p for p in sorted((root / "exports").iterdir()) if p.is_dir()]
    for path in candidates:
        # hidden: an export being written (``.final.tmp-*``), renamed into place only when complete
        if path.name == CHECKPOINTS or path.name.startswith(".") or not is_export_dir(path):
            continue
        rel = path.relative_to(root).as_posix()
        if known is not None and known(rel, path / EXPORT_MANIFEST):
            recorded.append(rel)
            continue
        unit = _export_unit(path, rel)
        if isinstance(unit, str):
            skipped[rel] = unit
        else:
            units.append(unit)
    if not units and not skipped and not recorded:
        raise SyncError(f"{root} holds no checkpoints/step_* directory and no export; nothing to sync")
    return _Plan(units, skipped, True, complete_steps, recorded)


def check_prefix(prefix: str | None) -> str:
    """A repository folder given by the user: relative, '/'-separated, no '.' or '..' part, no
    empty part; returned without surrounding slashes ("" = the repository root)."""
    text = (prefix or "").strip()
    if not text:
        return ""
    parts = text.split("/")
    bad = (text.startswith("/") or "\\" in text or any(p in ("", ".", "..") for p in parts)
           or any(ord(c) < 32 for c in text))
    if bad:
        raise SyncError(f"--path-in-repo {prefix!r} is not a folder of the repository: give a relative path such "
                        "as runs/pretrain (no leading '/', no '.' or '..' part, no empty part, no backslash)")
    return text


def prune_candidates(plan: _Plan, verified: set[str], keep_last: int) -> tuple[list[Unit], list[Unit]]:
    """The checkpoints of ``plan`` that ``--prune-local`` may delete (verified on the Hub, not among the
    newest ``keep_last``) and those it keeps; exports are in neither list."""
    keep_steps = set(sorted(plan.complete_steps)[-keep_last:])
    prune, keep = [], []
    for unit in plan.units:
        if unit.kind != "checkpoint":
            continue  # exports (the final one above all) are never pruned
        if unit.step in keep_steps or unit.name not in verified:
            keep.append(unit)
        else:
            prune.append(unit)
    return prune, keep


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file's bytes: what the Hub reports for non-LFS files."""
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def remote_files(api: HfApi, repo_id: str, unit: Unit, *, repo_type: str | None = None,
                 revision: str | None = None) -> dict[str, Any]:
    """Every file the Hub holds under the unit's folder (the whole repository for a root unit),
    by repository path, with its size and hashes; empty when the folder does not exist."""
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    def listing() -> list[Any]:
        try:
            return list(api.list_repo_tree(repo_id, path_in_repo=unit.folder or None, recursive=True,
                                           repo_type=repo_type, revision=revision))
        except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):  # not on the Hub yet
            return []

    entries = call_hub(f"listing {unit.folder or 'the root'} of {repo_id}", listing)
    return {entry.path: entry for entry in entries if hasattr(entry, "blob_id")}


def stale_remote_files(unit: Unit, remote: Mapping[str, Any]) -> list[str]:
    """Files on the Hub inside a unit's own folder that its manifest does not list (left there by
    an earlier run with another layout). A root unit (an export synced alone) owns no folder, so
    nothing beside it counts as stale."""
    if not unit.folder:
        return []
    wanted = {unit.remote(rel) for rel in unit.files}
    return sorted(path for path in remote if path not in wanted)


def remote_differences(api: HfApi, repo_id: str, unit: Unit, *, repo_type: str | None = None,
                       revision: str | None = None, remote: Mapping[str, Any] | None = None) -> list[str]:
    """One line per file of ``unit`` that is missing on the Hub or differs from the local file,
    and per stale file in the unit's folder."""
    if remote is None:
        remote = remote_files(api, repo_id, unit, repo_type=repo_type, revision=revision)
    problems = []
    for rel in sorted(unit.files):
        local, remote_path = unit.files[rel], unit.remote(rel)
        info = remote.get(remote_path)
        if info is None:
            problems.append(f"{remote_path}: missing on the Hub")
            continue
        if info.size != local["size"]:
            problems.append(f"{remote_path}: {info.size} bytes on the Hub, {local['size']} locally")
            continue
        lfs = getattr(info, "lfs", None)
        if lfs is not None:
            if lfs.sha256 != local["sha256"]:
                problems.append(f"{remote_path}: Hub SHA-256 {lfs.sha256} differs from local {local['sha256']}")
        elif info.blob_id != git_blob_sha1(unit.path / rel):
            problems.append(f"{remote_path}: Hub git blob id {info.blob_id} differs from the local file's")
    problems += [f"{path}: on the Hub but not in the local manifest" for path in stale_remote_files(unit, remote)]
    return problems
