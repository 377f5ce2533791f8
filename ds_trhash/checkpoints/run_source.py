"""A run's output directory named where a model is expected (``--init-checkpoint``, ``generate
--model``): which model directory of the run that means.

A completed stage writes ``final/`` (the verified export of its last checkpoint) and
``stage_complete.json`` naming that checkpoint (``release.lifecycle.final``, which takes these names
from here). A run directory then means the stage's last checkpoint while it is there, and its
``final/`` once ``ds-trhash cleanup`` removed it (``--keep packs`` keeps older pack checkpoints:
the newest remaining one is not the stage's result). A last checkpoint that is there but does not
verify is no cleanup: the run is refused, each checkpoint named with what is wrong with it, and
``RUN/final`` is the explicit way to its export. A run that has not completed means its newest
complete checkpoint whose records agree (newer ones are named and passed over). Only names, JSON
and the store's verification (``consistency`` reads DeepSpeed's record lazily).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.state import MANIFEST, CheckpointError
from ds_trhash.checkpoints.consistency import trusted
from ds_trhash.checkpoints.store import CheckpointInfo, checkpoints_root, list_checkpoints

FINAL_DIR = "final"
COMPLETE_FILE = "stage_complete.json"
COMPLETE_FORMAT = "ds-trhash-stage-complete-v1"
EXPORT_MANIFEST = "export_manifest.json"  # what makes a directory an export (release.export.manifest reads it)


def read_completion(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The completion record, or None when the stage has not completed (absent or unreadable)."""
    try:
        doc = json.loads((Path(output_dir) / COMPLETE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != COMPLETE_FORMAT or not isinstance(doc.get("step"), int):
        return None
    return doc


def is_run_dir(path: str | os.PathLike) -> bool:
    """An output directory of a launch (not one checkpoint, not an export)."""
    src = Path(path)
    if (src / MANIFEST).is_file() or (src / EXPORT_MANIFEST).is_file():
        return False
    return checkpoints_root(src).is_dir() or (src / COMPLETE_FILE).is_file() or (src / FINAL_DIR).is_dir()


def model_of_run(run: str | os.PathLike, flag: str, log: Callable[[str], None]) -> Path:
    """The model directory ``flag RUN`` means (said through ``log``); refuses a run holding none,
    and a completed run whose last checkpoint is there but not trusted."""
    src = Path(run)
    found = list_checkpoints(src)
    last = stage_result(src)
    if last is not None and os.path.lexists(last):  # the stage's result is there: it, or nothing
        ok, why = trusted(last)
        if not ok:
            raise CheckpointError(_untrusted_result(src, flag, last, why, found))
        log(f"{flag} {src}: the run's final complete checkpoint is {last} (the completed stage's last)")
        return last
    if last is not None and (src / FINAL_DIR).is_dir():
        log(f"{flag} {src}: the completed stage's last checkpoint is gone (cleanup); using its {src / FINAL_DIR}")
        return src / FINAL_DIR
    for info in reversed(found):
        ok, why = trusted(info.path)  # verified, and its own records agree
        if ok:
            log(f"{flag} {src}: the run's final complete checkpoint is {info.path}")
            return info.path
        log(f"{flag} {src}: {info.name} is {why}, passed over")
    listing = "; ".join(f"{c.name} is {trusted(c.path)[1]}" for c in found) or "none at all"
    raise CheckpointError(f"{flag} {src} is a run directory without a complete checkpoint or {FINAL_DIR}/ "
                          f"({listing}); pass a checkpoint directory (<run>/checkpoints/step_N) or an export")


def stage_result(run: Path) -> Path | None:
    """The checkpoint the completion record names as the stage's last (there or not); None when
    the stage has not completed or the record names none."""
    done = read_completion(run)
    name = done.get("checkpoint") if done is not None else None
    return run / name if isinstance(name, str) and name.strip() else None


def _untrusted_result(src: Path, flag: str, last: Path, why: str, found: list[CheckpointInfo]) -> str:
    """Why a completed run whose last checkpoint is present but not trusted is refused: every
    checkpoint there with what is wrong with it, and the explicit ways on."""
    def state(info: CheckpointInfo) -> str:
        ok, reason = (False, why) if info.path == last else trusted(info.path)
        return f"{info.name} is {reason}" if not ok else f"{info.name} verifies but is not the stage's last"

    listing = [state(c) for c in found]
    if last not in [c.path for c in found]:
        listing.insert(0, f"{last.name} is {why}")
    final = src / FINAL_DIR
    export = f"{flag} {final} takes its export explicitly, or " if final.is_dir() else ""
    return (f"{flag} {src}: the completed stage's last checkpoint {last} is present but cannot be used "
            f"({'; '.join(listing)}); a run directory means that checkpoint while it is present, and its "
            f"{FINAL_DIR}/ only once `ds-trhash cleanup` removed it: {export}pass a checkpoint directory that "
            "verifies (<run>/checkpoints/step_N)")
