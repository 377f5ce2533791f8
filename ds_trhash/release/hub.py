"""Sync complete checkpoints and exports to the Hugging Face Hub (docs/contracts.md §9).

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

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints import CHECKPOINTS, ENGINE_TAG, MANIFEST, TRAINER_STATE, list_checkpoints, verify
from ds_trhash.checkpoints.sync_guard import LOCK_FILE, LockHeld, output_lock, read_verified, update_verified
from ds_trhash.errors import UserError
from ds_trhash.io import remove_dir, sha256_file
from ds_trhash.release.export import EXPORT_MANIFEST, WEIGHTS, export_files, read_export_manifest, verify_export

TOKEN_ENV = "HF_TOKEN"
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{8,}")

Log = Callable[[str], None]


class SyncError(UserError, RuntimeError):
    """A sync that did not complete; ``report`` says what was done before it stopped."""

    def __init__(self, message: str, report: "SyncReport | None" = None):
        super().__init__(redact(message))
        self.report = report

    def message_lines(self) -> list[str]:
        """The first line, then the per-file differences when verification failed."""
        return str(self).splitlines() or [""]


# --------------------------------------------------------------------------- token handling


def redact(text: str) -> str:
    """Remove the access token (and anything shaped like a Hub token) from text."""
    token = os.environ.get(TOKEN_ENV)
    if token and len(token) >= 4:
        text = text.replace(token, "<redacted>")
    return _TOKEN_PATTERN.sub("hf_<redacted>", text)


def check_repo_id(repo_id: str) -> None:
    """A repository id the Hub accepts (``namespace/name`` of letters, digits, ``-_.``), before
    anything is read, locked or sent."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise SyncError(f"--repo-id {repo_id!r} is not a valid repository id ({' '.join(str(exc).split())[:200]}); "
                        "use namespace/name with letters, digits, '-', '_' and '.'") from None


def make_api(*, require_token: bool = True) -> Any:
    """An ``HfApi`` authenticated by ``HF_TOKEN`` only.

    Without the variable: an error when a token is required, else an anonymous client
    (``token=False``: never read from a token file).
    """
    from huggingface_hub import HfApi

    token = os.environ.get(TOKEN_ENV) or None
    if token is None and require_token:
        raise SyncError(f"{TOKEN_ENV} is not set: export it in the environment of this process (tokens are never "
                        "read from files, arguments or configs)")
    return HfApi(token=token if token is not None else False)


# --------------------------------------------------------------------------- lock


@contextlib.contextmanager
def sync_lock(directory: str | os.PathLike, timeout: float = 0.0) -> Iterator[Path]:
    """The output directory's lock (``checkpoints.sync_guard.output_lock``), which the trainer's
    rotation takes too; ``timeout`` 0 fails at once when held."""
    try:
        with output_lock(directory, timeout) as path:
            yield path
    except LockHeld as exc:
        raise SyncError(str(exc)) from None


# --------------------------------------------------------------------------- local units


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
        from dataclasses import asdict

        return asdict(self)


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


def _is_checkpoint(path: Path) -> bool:
    return any((path / n).exists() for n in (MANIFEST, TRAINER_STATE, ENGINE_TAG))


def _is_export(path: Path) -> bool:
    return (path / EXPORT_MANIFEST).is_file() or (path / WEIGHTS).is_file()


@dataclass
class _Plan:
    units: list[Unit]
    skipped: dict[str, str]
    prunable: bool  # an output directory (not a single unit) was given
    complete_steps: list[int]
    recorded: list[str] = field(default_factory=list)  # verified by an earlier sync: left alone


def recorded_as_verified(records: Mapping[str, Mapping[str, Any]], name: str, manifest: Path, repo_id: str,
                         prefix: str) -> bool:
    """Whether ``sync_verified.json`` (``records``) says unit ``name`` is on ``repo_id`` under
    ``prefix`` with exactly the manifest it has now."""
    entry = records.get(name)
    return (entry is not None and entry.get("repo_id") == repo_id and entry.get("prefix", "") == prefix
            and manifest.is_file() and entry.get("manifest_sha256") == sha256_file(manifest))


def discover(local_dir: str | os.PathLike, known: Callable[[str, Path], bool] | None = None) -> _Plan:
    """What ``local_dir`` holds: a run output directory, one checkpoint, or one export.
    ``known(name, manifest)``: units of a run directory for which it is true are not hashed
    again but listed in ``recorded`` (``sync(incremental=True)``)."""

    root = Path(local_dir)
    if not root.is_dir():
        raise SyncError(f"{root} is not a directory")
    if _is_checkpoint(root):
        unit = _checkpoint_unit(root, f"{CHECKPOINTS}/{root.name}")
        if isinstance(unit, str):
            raise SyncError(f"{root} is {unit}; only complete checkpoints are uploaded")
        return _Plan([unit], {}, False, [])
    if _is_export(root):
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
        if path.name == CHECKPOINTS or path.name.startswith(".") or not _is_export(path):
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


# --------------------------------------------------------------------------- remote checks


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file's bytes: what the Hub reports for non-LFS files."""
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except SyncError:
        raise
    except Exception as exc:  # network, auth, HTTP: reported without the original (token-bearing) chain
        raise SyncError(f"{what} failed: {type(exc).__name__}: {exc}") from None


def probe_hub(api: Any, repo_id: str, repo_type: str | None, revision: str | None = None,
              timeout: float = 10.0) -> None:
    """One request without retries, before a dry run reads the listings (which retry for about
    half a minute): an endpoint that does not answer fails the dry run at once, saying so; a
    repository that does not exist yet is an answer (everything would be uploaded)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        api.repo_info(repo_id, repo_type=repo_type, revision=revision or "main", timeout=timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return
    except Exception as exc:  # connection refused, timeout, HTTP error: reported without the chain
        raise SyncError(f"dry run: could not read {repo_id} on the Hub ({type(exc).__name__}: {exc}), so nothing is "
                        "reported as to upload: check HF_ENDPOINT, the network and HF_TOKEN") from None


def remote_files(api: Any, repo_id: str, unit: Unit, *, repo_type: str | None = None,
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

    entries = _call(f"listing {unit.folder or 'the root'} of {repo_id}", listing)
    return {entry.path: entry for entry in entries if hasattr(entry, "blob_id")}


def stale_remote_files(unit: Unit, remote: Mapping[str, Any]) -> list[str]:
    """Files on the Hub inside a unit's own folder that its manifest does not list (left there by
    an earlier run with another layout). A root unit (an export synced alone) owns no folder, so
    nothing beside it counts as stale."""
    if not unit.folder:
        return []
    wanted = {unit.remote(rel) for rel in unit.files}
    return sorted(path for path in remote if path not in wanted)


def remote_differences(api: Any, repo_id: str, unit: Unit, *, repo_type: str | None = None,
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


# --------------------------------------------------------------------------- sync


def _upload(api: Any, repo_id: str, unit: Unit, stale: list[str], repo_type: str | None,
            revision: str | None) -> None:
    """One commit per unit: its files (the client skips those already identical on the Hub) and
    the deletion of stale files in its folder, so the remote folder equals the manifest."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    operations: list[Any] = [CommitOperationAdd(path_in_repo=unit.remote(rel), path_or_fileobj=str(unit.path / rel))
                             for rel in sorted(unit.files)]
    operations += [CommitOperationDelete(path_in_repo=path) for path in stale]
    _call(f"uploading {unit.name} to {repo_id}", api.create_commit, repo_id, operations,
          commit_message=f"ds-trhash sync: {unit.kind} {unit.name}", repo_type=repo_type, revision=revision)


def _mark_verified(lock_dir: Path, unit: Unit, repo_id: str) -> None:
    """Tell the trainer's rotation (``checkpoint.keep_unsynced``), cleanup and the watcher that
    this unit is on the Hub, with exactly this manifest (and where: repository and prefix)."""
    manifest = MANIFEST if unit.kind == "checkpoint" else EXPORT_MANIFEST
    entry = {"manifest_sha256": unit.files[manifest]["sha256"], "repo_id": repo_id}
    if unit.prefix:
        entry["prefix"] = unit.prefix
    update_verified(lock_dir, add={unit.name: entry})


def _prune_candidates(plan: _Plan, verified: set[str], keep_last: int) -> tuple[list[Unit], list[Unit]]:
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


def sync(
    local_dir: str | os.PathLike,
    repo_id: str,
    api: Any,
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
    say: Log = lambda line: log(redact(line))  # noqa: E731
    check_repo_id(repo_id)
    report = SyncReport(repo_id=repo_id, dry_run=dry_run)
    root = Path(local_dir)
    lock_dir = discover_lock_dir(root)
    if incremental and prune_local:
        raise SyncError("--incremental trusts the record of earlier passes; --prune-local needs every unit "
                        "verified now: use one of them")
    with sync_lock(lock_dir, lock_timeout):
        records = read_verified(lock_dir) if incremental else {}
        plan = discover(root, (lambda name, manifest: recorded_as_verified(records, name, manifest, repo_id, prefix))
                        if incremental else None)
        for unit in plan.units:
            unit.prefix = prefix
        report.already_remote += plan.recorded
        for name in plan.recorded:
            say(f"{name}: verified on {repo_id} by an earlier sync (sync_verified.json); not checked again")
        if prune_local and not plan.prunable:
            raise SyncError(f"--prune-local needs the run output directory (the one holding checkpoints/), not the "
                            f"single {plan.units[0].kind} {root}")
        report.skipped = dict(plan.skipped)
        for name, why in plan.skipped.items():
            say(f"skip {name}: it is {why}; only complete checkpoints are uploaded")
        verified: set[str] = set()
        try:
            if not dry_run and plan.units:
                _call(f"creating {repo_id}", api.create_repo, repo_id, repo_type=repo_type, private=True,
                      exist_ok=True)
            elif plan.units:
                probe_hub(api, repo_id, repo_type, revision)
            for unit in plan.units:
                # a Hub that cannot be read fails a dry run too: it could not say what it would upload
                remote = remote_files(api, repo_id, unit, repo_type=repo_type, revision=revision)
                before = remote_differences(api, repo_id, unit, remote=remote)
                if not before:
                    report.already_remote.append(unit.name)
                    verified.add(unit.name)
                    if not dry_run:
                        _mark_verified(lock_dir, unit, repo_id)
                    say(f"{unit.name}: already on {repo_id}, every file verified")
                    continue
                if dry_run:
                    report.would_upload.append(unit.name)
                    say(f"would upload {unit.name} ({len(unit.files)} files)")
                    continue
                say(f"uploading {unit.name} ({len(unit.files)} files) to {repo_id}")
                _upload(api, repo_id, unit, stale_remote_files(unit, remote), repo_type, revision)
                report.uploaded.append(unit.name)
                after = remote_differences(api, repo_id, unit, repo_type=repo_type, revision=revision)
                if after:
                    raise SyncError(f"{unit.name} does not verify on {repo_id} after upload; nothing was pruned:\n"
                                    + "\n".join(f"  - {p}" for p in after))
                verified.add(unit.name)
                _mark_verified(lock_dir, unit, repo_id)
                report.verified.append(unit.name)
                say(f"{unit.name}: every file verified on {repo_id}")
        except SyncError as exc:
            report.error = str(exc)
            raise SyncError(str(exc), report) from None

        if prune_local:
            assume = verified | set(report.would_upload) if dry_run else verified
            prune, keep = _prune_candidates(plan, assume, keep_last)
            report.kept = [u.name for u in keep]
            for unit in prune:
                if dry_run:
                    report.would_prune.append(unit.name)
                    say(f"would prune local {unit.name} once verified on the Hub")
                    continue
                remove_dir(unit.path)
                update_verified(lock_dir, remove=(unit.name,))
                report.pruned.append(unit.name)
                say(f"pruned local {unit.name} (verified on {repo_id})")
    return report


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


def discover_lock_dir(root: Path) -> Path:
    """The output directory whose lock guards ``root`` (the same for a run, its checkpoints and
    its exports)."""

    if root.is_dir() and _is_checkpoint(root):
        return root.parent.parent if root.parent.name == CHECKPOINTS else root.parent
    if root.is_dir() and _is_export(root):
        return root.parent.parent if root.parent.name == "exports" else root.parent
    return root


def summary(report: SyncReport | Mapping[str, Any]) -> str:
    doc = report.to_dict() if isinstance(report, SyncReport) else dict(report)
    parts = [f"{key} {len(doc[key])}" for key in ("uploaded", "already_remote", "verified", "pruned", "kept",
                                                 "skipped", "would_upload", "would_prune") if doc.get(key)]
    return redact(f"sync {doc['repo_id']}{' (dry run)' if doc.get('dry_run') else ''}: "
                  + (", ".join(parts) or "nothing to do"))
