"""Sync complete checkpoints and exports to the Hugging Face Hub (docs/contracts.md §9).

This module is the upload loop and its report; what a unit is and how it is compared with the
Hub live in ``units``, the lock and the verified record in ``lock``, the token and the
``HfApi`` in ``client``. The names callers use are importable from here too.

Rules, in the order ``sync`` applies them:

1. One lock per output directory (``<output_dir>/.sync.lock``, ``fcntl.flock``) is held for
   discovery, upload, remote verification and pruning, so deletion and upload never race.
   A second sync fails fast instead of waiting, unless ``lock_timeout`` seconds are granted;
   the trainer's rotation takes the same lock (``checkpoints.sync_guard``) and, while a sync
   holds it, leaves rotation for its next checkpoint.
2. Only complete units are uploaded: a checkpoint must pass ``checkpoint.verify`` (every file
   against its MANIFEST.json), an export must pass ``verify_export``. Only the files those
   manifests vouch for are uploaded, with the manifest itself.
3. After upload every remote file is checked against the local hash: LFS files by their
   SHA-256 (``RepoFile.lfs.sha256``), regular git files by their git blob id (SHA-1 of
   ``"blob <size>\\0" + bytes``), both from ``HfApi.list_repo_tree`` of the unit's folder. Files
   in that folder that the manifest does not list are deleted in the unit's upload commit.
4. Any failure (upload or verification) stops the sync and prunes nothing. Pruning removes
   only checkpoints whose every file verified remotely, never the newest ``keep_last``
   checkpoints, never an export, never anything incomplete.
5. Every checkpoint verified on the Hub is recorded, with its manifest's SHA-256, in
   ``<output_dir>/sync_verified.json``; rotation with ``checkpoint.keep_unsynced`` deletes only
   checkpoints recorded there.
6. The access token comes only from ``HF_TOKEN`` in the environment (``make_api``); it is
   passed to ``HfApi`` explicitly so the library never falls back to a token file, and it is
   scrubbed from every log line and error message this module produces.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_trhash.checkpoints.sync_guard import read_verified, update_verified
from ds_trhash.io import remove_dir
from ds_trhash.release.hub.client import (TOKEN_ENV, Log, SyncError, call_hub, check_repo_id, make_api, probe_hub,
                                          redact)
from ds_trhash.release.hub.lock import discover_lock_dir, mark_verified, recorded_as_verified, sync_lock
from ds_trhash.release.hub.units import (Unit, _Plan, check_prefix, discover, git_blob_sha1, prune_candidates,
                                         remote_differences, remote_files, stale_remote_files)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = ["TOKEN_ENV", "SyncError", "SyncReport", "Unit", "check_prefix", "check_repo_id", "discover",
           "discover_lock_dir", "git_blob_sha1", "make_api", "probe_hub", "recorded_as_verified", "redact",
           "remote_differences", "remote_files", "stale_remote_files", "summary", "sync", "sync_lock"]


@dataclass
class SyncReport:
    repo_id: str
    dry_run: bool = False
    uploaded: list[str] = field(default_factory=list)
    already_remote: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # unit -> why it was not uploaded
    would_upload: list[str] = field(default_factory=list)
    would_prune: list[str] = field(default_factory=list)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _upload(api: HfApi, repo_id: str, unit: Unit, stale: list[str], repo_type: str | None,
            revision: str | None) -> None:
    """One commit per unit: its files (the client skips those already identical on the Hub) and
    the deletion of stale files in its folder, so the remote folder equals the manifest."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    operations: list[Any] = [CommitOperationAdd(path_in_repo=unit.remote(rel), path_or_fileobj=str(unit.path / rel))
                             for rel in sorted(unit.files)]
    operations += [CommitOperationDelete(path_in_repo=path) for path in stale]
    call_hub(f"uploading {unit.name} to {repo_id}", api.create_commit, repo_id, operations,
          commit_message=f"ds-trhash sync: {unit.kind} {unit.name}", repo_type=repo_type, revision=revision)


@dataclass
class _Pass:
    """One sync pass: where it writes, what it reports, how it speaks."""

    api: HfApi
    repo_id: str
    repo_type: str | None
    revision: str | None
    lock_dir: Path
    report: SyncReport
    say: Log
    dry_run: bool


def sync(
    local_dir: str | os.PathLike,
    repo_id: str,
    api: HfApi,
    *,
    prune_local: bool = False,
    keep_last: int = 1,
    dry_run: bool = False,
    repo_type: str | None = None,
    revision: str | None = None,
    lock_timeout: float = 0.0,
    path_in_repo: str = "",
    incremental: bool = False,
    log: Log = print,
) -> SyncReport:
    """Upload every complete checkpoint/export under ``local_dir``, verify it on the Hub, then
    (with ``prune_local``) delete verified local checkpoints beyond the newest ``keep_last``.

    Raises ``SyncError`` (with ``.report``) on the first upload or verification failure; nothing
    is pruned then. ``dry_run`` reads the Hub but writes and deletes nothing. ``path_in_repo``:
    a folder of the repository under which the run's units go (``check_prefix``). ``incremental``
    (the watcher's passes): units that ``sync_verified.json`` records on this repository and
    prefix with their current manifest are trusted, neither hashed nor listed again.
    """
    if keep_last < 1:
        raise SyncError(f"keep_last must be >= 1, got {keep_last}: the newest checkpoint is always kept")
    prefix = check_prefix(path_in_repo)
    check_repo_id(repo_id)
    if incremental and prune_local:
        raise SyncError("--incremental trusts the record of earlier passes; --prune-local needs every unit "
                        "verified now: use one of them")
    root = Path(local_dir)
    one = _Pass(api, repo_id, repo_type, revision, discover_lock_dir(root), SyncReport(repo_id=repo_id, dry_run=dry_run),
                lambda line: log(redact(line)), dry_run)
    with sync_lock(one.lock_dir, lock_timeout):
        plan = _units(one, root, prefix, incremental, prune_local)
        verified: set[str] = set()
        try:
            _open_repo(one, plan)
            for unit in plan.units:
                if _sync_unit(one, unit):
                    verified.add(unit.name)
        except SyncError as exc:
            one.report.error = str(exc)
            raise SyncError(str(exc), one.report) from None
        if prune_local:
            _prune(one, plan, verified, keep_last)
    return one.report


def _units(one: _Pass, root: Path, prefix: str, incremental: bool, prune_local: bool) -> _Plan:
    """The units under ``root`` (those an earlier pass verified left out when ``incremental``)."""
    records = read_verified(one.lock_dir) if incremental else {}
    plan = discover(root, (lambda name, manifest: recorded_as_verified(records, name, manifest, one.repo_id, prefix))
                    if incremental else None)
    for unit in plan.units:
        unit.prefix = prefix
    one.report.already_remote += plan.recorded
    for name in plan.recorded:
        one.say(f"{name}: verified on {one.repo_id} by an earlier sync (sync_verified.json); not checked again")
    if prune_local and not plan.prunable:
        raise SyncError(f"--prune-local needs the run output directory (the one holding checkpoints/), not the "
                        f"single {plan.units[0].kind} {root}")
    one.report.skipped = dict(plan.skipped)
    for name, why in plan.skipped.items():
        one.say(f"skip {name}: it is {why}; only complete checkpoints are uploaded")
    return plan


def _open_repo(one: _Pass, plan: _Plan) -> None:
    """Create the repository (private) before an upload; a dry run only proves it can read it."""
    if not plan.units:
        return
    if one.dry_run:
        probe_hub(one.api, one.repo_id, one.repo_type, one.revision)
    else:
        call_hub(f"creating {one.repo_id}", one.api.create_repo, one.repo_id, repo_type=one.repo_type, private=True,
                 exist_ok=True)


def _sync_unit(one: _Pass, unit: Unit) -> bool:
    """Upload one unit unless the Hub holds it already, then verify it; whether it is verified
    (a dry run verifies nothing it would upload). A Hub that cannot be read fails a dry run too:
    it could not say what it would upload."""
    api, repo_id, report = one.api, one.repo_id, one.report
    remote = remote_files(api, repo_id, unit, repo_type=one.repo_type, revision=one.revision)
    if not remote_differences(api, repo_id, unit, remote=remote):
        report.already_remote.append(unit.name)
        if not one.dry_run:
            mark_verified(one.lock_dir, unit, repo_id)
        one.say(f"{unit.name}: already on {repo_id}, every file verified")
        return True
    if one.dry_run:
        report.would_upload.append(unit.name)
        one.say(f"would upload {unit.name} ({len(unit.files)} files)")
        return False
    one.say(f"uploading {unit.name} ({len(unit.files)} files) to {repo_id}")
    _upload(api, repo_id, unit, stale_remote_files(unit, remote), one.repo_type, one.revision)
    report.uploaded.append(unit.name)
    after = remote_differences(api, repo_id, unit, repo_type=one.repo_type, revision=one.revision)
    if after:
        raise SyncError(f"{unit.name} does not verify on {repo_id} after upload; nothing was pruned:\n"
                        + "\n".join(f"  - {p}" for p in after))
    mark_verified(one.lock_dir, unit, repo_id)
    report.verified.append(unit.name)
    one.say(f"{unit.name}: every file verified on {repo_id}")
    return True


def _prune(one: _Pass, plan: _Plan, verified: set[str], keep_last: int) -> None:
    """Delete verified local checkpoints beyond the newest ``keep_last`` (a dry run says which)."""
    assume = verified | set(one.report.would_upload) if one.dry_run else verified
    prune, keep = prune_candidates(plan, assume, keep_last)
    one.report.kept = [u.name for u in keep]
    for unit in prune:
        if one.dry_run:
            one.report.would_prune.append(unit.name)
            one.say(f"would prune local {unit.name} once verified on the Hub")
            continue
        remove_dir(unit.path)
        update_verified(one.lock_dir, remove=(unit.name,))
        one.report.pruned.append(unit.name)
        one.say(f"pruned local {unit.name} (verified on {one.repo_id})")


def summary(report: SyncReport | Mapping[str, Any]) -> str:
    doc = report.to_dict() if isinstance(report, SyncReport) else dict(report)
    parts = [f"{key} {len(doc[key])}" for key in ("uploaded", "already_remote", "verified", "pruned", "kept",
                                                 "skipped", "would_upload", "would_prune") if doc.get(key)]
    return redact(f"sync {doc['repo_id']}{' (dry run)' if doc.get('dry_run') else ''}: "
                  + (", ".join(parts) or "nothing to do"))
