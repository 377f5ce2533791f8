"""A run's output directory named where a model is expected (``--init-checkpoint``, ``generate
--model``): which model directory of the run that means.

A completed stage writes ``final/`` (the verified export of its last checkpoint) and
``stage_complete.json`` naming that checkpoint (``release.lifecycle.final``, which takes these names
from here). A run directory then means the stage's last checkpoint while it is there, and its
``final/`` once ``ds-trhash cleanup`` removed it (``--keep packs`` keeps older pack checkpoints:
the newest remaining one is not the stage's result). A run that has not completed means its
newest complete checkpoint. No torch: only names, JSON and the store's verification.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.state import MANIFEST, CheckpointError
from ds_trhash.checkpoints.consistency import trusted
from ds_trhash.checkpoints.store import checkpoints_root, list_checkpoints, verify

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
    """The model directory ``flag RUN`` means (said through ``log``); refuses a run holding none."""
    src = Path(run)
    done = read_completion(src)
    found = list_checkpoints(src)
    if done is not None:
        last = src / str(done.get("checkpoint", ""))
        if (last / MANIFEST).is_file() and verify(last)[0]:
            log(f"{flag} {src}: the run's final complete checkpoint is {last} (the completed stage's last)")
            return last
        if (src / FINAL_DIR).is_dir():
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
