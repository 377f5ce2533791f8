"""The run folder's files a run record reads (``writer``): metrics.csv, piqa.jsonl, JSON documents,
and the framework's git commit. A file that is missing reads as nothing; one that is damaged where
a published number would come from is refused (``RecordError``), so the record never publishes a
guess."""
from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from ds_trhash.errors import UserError
from ds_trhash.io import read_utf8, utf8_lines


class RecordError(UserError, ValueError):
    """The run record cannot be built from what was given (not a run folder, unknown field)."""



def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    return doc if isinstance(doc, dict) else None


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """``git rev-parse HEAD`` of the framework checkout; None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def read_metrics(path: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv. Every cell of a numeric column must be empty or a number
    (nan and inf included: a diverged loss is a number): anything else would be published as null."""
    if not path.is_file():
        return []
    rows = list(csv.DictReader(utf8_lines(path, RecordError)))
    for line_no, row in enumerate(rows, 2):
        for key, text in row.items():
            if key is None or not text or key.endswith("_backend"):
                continue
            try:
                float(text)
            except (TypeError, ValueError):
                raise RecordError(f"{path}: line {line_no}, column {key}: {text!r} is not a number; "
                                  "restore the file the trainer wrote (or remove that row)") from None
    return rows


def number(text: str | None) -> float | int | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def checkpoint_metrics(step: int, rows: list[dict[str, str]]) -> dict[str, Any]:
    """The eval row at ``step`` and the last train row at or before it."""
    out: dict[str, Any] = {}
    for row in rows:
        if number(row.get("step")) != step:
            continue
        for key in ("eval_loss", "eval_ppl", "eval_tokens"):
            if row.get(key):
                out[key] = number(row[key])
    train = [r for r in rows if r.get("train_loss") and (number(r.get("step")) or 0) <= step]
    if train:
        last = train[-1]
        # no "epoch": that row may precede the checkpoint's step; the checkpoint records its own
        for key in ("train_loss", "train_ppl", "lr", "tok_s", "tokens_seen"):
            if last.get(key):
                out[key] = number(last[key])
        out["train_row_step"] = number(last.get("step"))
    return out


def read_piqa_rows(path: Path) -> dict[int, dict[str, Any]]:
    """The run's ``piqa.jsonl`` by step (a step evaluated twice, e.g. around a resume, keeps its
    last row)."""
    rows: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return rows
    for line in read_utf8(path, RecordError).splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows[row["step"]] = {k: row.get(k) for k in ("step", "epoch", "acc", "acc_norm", "n", "warning")}
    return rows
