"""``micro_batch.json``: the micro-batch in force, written durably at every change.

An out-of-memory step lowers the micro-batch; the next launch of the run (``--resume auto``, the
SLURM script's requeue) must train at the lowered size, whether the change was made in place and
the run went on (a checkpoint may not have been written since) or the rank that ran out of
memory ended every rank (exit 77). The file holds the size in force and every change, with the
step and the rank; the checkpoint records name it as well (``micro_batch_in_force``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ds_trhash.io import write_json_atomic

MICRO_BATCH_FILE = "micro_batch.json"


def read_record(output_dir: str | Path) -> dict[str, Any] | None:
    """The run's record, or None when no step ran out of memory (or the file is unreadable)."""
    path = Path(output_dir) / MICRO_BATCH_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("micro_batch"), int) else None


def record_change(output_dir: str | Path, *, step: int, rank: int, old: int, new: int, grad_accum: int,
                  how: str) -> dict[str, Any]:
    """Append one change (``how``: "in place" or "exit") and make ``new`` the size in force, durably
    (written to a temporary file, synced, renamed)."""
    record = read_record(output_dir) or {"events": []}
    event = {"step": step, "rank": rank, "from": old, "to": new, "grad_accum": grad_accum, "how": how,
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    record.update(micro_batch=new, grad_accum=grad_accum, events=[*record.get("events", []), event])
    write_json_atomic(Path(output_dir) / MICRO_BATCH_FILE, record)
    return event


def exit_event(output_dir: str | Path, since: float) -> dict[str, Any] | None:
    """The last change if it ended the ranks ("exit") and was written after ``since`` (epoch
    seconds: this launch's start): what a rank whose collective failed reports instead of a lost
    peer."""
    record = read_record(output_dir)
    path = Path(output_dir) / MICRO_BATCH_FILE
    if record is None or not record.get("events") or record["events"][-1].get("how") != "exit":
        return None
    try:
        if path.stat().st_mtime < since:
            return None
    except OSError:
        return None
    return record["events"][-1]
