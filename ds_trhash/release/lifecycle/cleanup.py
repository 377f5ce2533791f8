"""Cleanup after success: delete a run's numbered checkpoints once nothing depends on them.

``ds-trhash cleanup RUN_DIR`` and ``training.cleanup_after_success`` delete checkpoints only when
every condition holds, and otherwise refuse naming the first that fails, deleting nothing:

1. no launch is alive in the directory (``checkpoints.run_lock``), other than the caller's own;
2. the stage completed (``stage_complete.json``, ``release.lifecycle.final``);
3. ``final/`` exists, verifies (every file against its manifest) and is the export of the
   stage's last checkpoint;
4. when the run syncs to the Hub (its config sets ``checkpoint.keep_unsynced``, or a sync has
   left ``sync_verified.json``), every checkpoint to be deleted is recorded there as verified on
   the Hub with its current manifest.

What goes: ``keep_packs`` deletes the numbered checkpoints that are neither a token-pack
boundary nor an epoch end; ``keep_final`` deletes every numbered checkpoint. ``final/``,
``best/`` and every other file of the run stay. Deletion runs under the output directory's sync
lock, so it never races a Hub sync or the watcher, and each directory is renamed away before it
is removed (``io.remove_dir``): a crash half-way leaves no partial checkpoint under a trusted name.
"""
from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ds_trhash.checkpoints import CHECKPOINTS, MANIFEST, CheckpointError, list_checkpoints, read_trainer_state
from ds_trhash.checkpoints.run_lock import describe_holder, is_alive
from ds_trhash.checkpoints.sync_guard import VERIFIED_FILE, LockHeld, is_verified, output_lock, read_verified
from ds_trhash.errors import UserError
from ds_trhash.io import remove_dir, sha256_file
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR, final_status, read_completion

MODES = ("keep_packs", "keep_final")
Log = Callable[[str], None]


class CleanupRefused(UserError, RuntimeError):
    """A condition for deleting checkpoints does not hold; nothing was deleted."""


@dataclass
class CleanupReport:
    mode: str
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    dry_run: bool = False


def run_syncs(output_dir: Path) -> bool:
    """Whether the run backs its checkpoints up to the Hub: its config says so
    (``checkpoint.keep_unsynced``) or a sync has recorded verified units."""
    try:
        cfg = json.loads((output_dir / "config.json").read_text(encoding="utf-8"))
        declared = bool((cfg.get("checkpoint") or {}).get("keep_unsynced"))
    except (OSError, ValueError, AttributeError):
        declared = False
    return declared or (output_dir / VERIFIED_FILE).exists()


def _protected(path: Path) -> bool:
    """A token-pack boundary or an epoch end (what rotation never removes either)."""
    try:
        doc = read_trainer_state(path)
    except CheckpointError:
        return True  # unreadable: never deleted by a convenience command
    return doc.get("pack_index") is not None or str(doc.get("reason", "")).startswith("end of epoch")


def _refuse(output_dir: Path, condition: str, how: str) -> CleanupRefused:
    return CleanupRefused(f"cleanup of {output_dir} refused: {condition}; {how} (nothing was deleted)")


def check_run_dir(out: Path, mode: str) -> None:
    """Refuse a mode or a directory that cannot be meant, before anything (a lock file) is created."""
    if mode not in MODES:
        raise CleanupRefused(f"cleanup mode {mode!r} is not one of {', '.join(MODES)}")
    if not out.is_dir() or not (list_checkpoints(out) or (out / COMPLETE_FILE).exists()
                                or (out / "config.json").exists()):
        raise CleanupRefused(f"{out} is not a run output directory (no checkpoints/, config.json or {COMPLETE_FILE}); "
                             "pass the --output-dir of a training launch")


def _write_final_advice(out: Path, source: Path) -> str:
    """A command that writes a ``final/`` cleanup accepts: the export of the recorded checkpoint."""
    final = out / FINAL_DIR
    aside = f"move {final} aside, then " if final.exists() or final.is_symlink() else ""
    if (source / MANIFEST).is_file():
        return f"{aside}write it with `ds-trhash export --checkpoint {source} --out {final}`"
    return (f"the checkpoint {source} it records is gone too: restore {final} (from the Hub backup) "
            "or keep the checkpoints")


def plan(output_dir: str | os.PathLike, mode: str) -> tuple[list[Path], list[Path]]:
    """(to delete, to keep) among the numbered checkpoints, after every condition is checked."""
    out = Path(output_dir)
    check_run_dir(out, mode)
    holder = is_alive(out)
    if holder is not None and not (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
        raise _refuse(out, f"a launch is still running there ({describe_holder(holder)})",
                      "run cleanup after it has exited")
    done = read_completion(out)
    if done is None:
        raise _refuse(out, f"the stage has not completed (no readable {COMPLETE_FILE})",
                      "finish the stage (RESUME=auto continues it) before cleaning up")
    source = out / done.get("checkpoint", "")
    ok, why = final_status(out, source if (source / MANIFEST).is_file() else None)
    if not ok:
        raise _refuse(out, f"{FINAL_DIR}/ does not verify ({why})", _write_final_advice(out, source))
    delete, keep = [], []
    for info in list_checkpoints(out):
        if not info.has_manifest or (mode == "keep_packs" and _protected(info.path)):
            keep.append(info.path)
        else:
            delete.append(info.path)
    if delete and run_syncs(out):
        verified = read_verified(out)
        missing = [p.name for p in delete
                   if not is_verified(verified, f"{CHECKPOINTS}/{p.name}", sha256_file(p / MANIFEST))]
        if missing:
            raise _refuse(out, f"{', '.join(missing)} not verified on the Hub ({VERIFIED_FILE}) and the run syncs",
                          "let `ds-trhash sync` (or `sync --watch`) upload and verify them first")
    return delete, keep


def cleanup(output_dir: str | os.PathLike, mode: str = "keep_packs", *, dry_run: bool = False,
            lock_timeout: float = 0.0, log: Log = print) -> CleanupReport:
    """Check every condition, then delete (under the sync lock). Raises ``CleanupRefused``."""
    out = Path(output_dir)
    report = CleanupReport(mode=mode, dry_run=dry_run)
    check_run_dir(out, mode)
    try:
        with output_lock(out, lock_timeout):
            delete, keep = plan(out, mode)
            report.kept = [p.name for p in keep]
            for path in delete:
                if not dry_run:
                    remove_dir(path)
                report.removed.append(path.name)
                log(f"{'would remove' if dry_run else 'removed'} {CHECKPOINTS}/{path.name}")
    except LockHeld as exc:
        raise _refuse(out, f"a Hub sync or rotation holds the output directory's lock ({exc})",
                      "run cleanup once it has finished") from None
    return report
