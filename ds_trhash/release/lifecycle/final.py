"""The end of a completed stage: ``<output_dir>/final/`` and the completion record.

A stage that ran every planned step writes, on rank 0 and before the launch reports success:

- ``final/``: the same verified export ``ds-trhash export`` writes (docs/contracts.md §9), of the
  stage's last checkpoint. It is built in a hidden temporary directory and renamed into place
  (``export.export_safetensors``), so ``final/`` is either absent or complete; a temporary
  directory left by a crash is removed by the next attempt.
- ``stage_complete.json``: the stage, the step, the checkpoint ``final/`` came from and the
  SHA-256 of ``final/export_manifest.json``. It is written last, atomically; the Hub watcher
  (``release.hub.watch``) and cleanup (``release.lifecycle.cleanup``) take it as "the stage completed".

Both are idempotent: a finished stage relaunched with ``RESUME=auto`` writes what is missing and
keeps what verifies. A ``final/`` that does not verify, or that was exported from another
checkpoint, is renamed aside (never deleted) and written again (``lifecycle.write_final``).

This module holds the names, the checks and the completion record, and imports no torch: the
watcher and cleanup read them on every pass. Writing ``final/`` (the exporter) is in ``finish``.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ds_trhash.checkpoints import MANIFEST, capped_by, list_checkpoints, verify
from ds_trhash.checkpoints.run_source import COMPLETE_FILE, COMPLETE_FORMAT, FINAL_DIR, read_completion
from ds_trhash.io import sha256_file, write_json_atomic
from ds_trhash.release.export.manifest import EXPORT_MANIFEST, RUN, ExportError, verify_export

__all__ = ["COMPLETE_FILE", "COMPLETE_FORMAT", "FINAL_DIR", "export_final_enabled", "final_checkpoint",
           "final_status", "read_completion", "write_completion"]

Log = Callable[[str], None]


class EndSettings(Protocol):
    """The ``training`` section's end-of-stage settings (release cannot import training's config)."""

    @property
    def export_final(self) -> bool | None: ...

    @property
    def cleanup_after_success(self) -> str: ...


class StageSettings(Protocol):
    """What the end of a stage reads of the launch's TrainConfig."""

    @property
    def stage(self) -> str: ...

    @property
    def training(self) -> EndSettings: ...


def export_final_enabled(cfg: StageSettings) -> bool:
    """``training.export_final``; unset means on, for every stage (SFT too: ``final/`` beside
    ``best/``, so a finished run folder always holds a verified export with its tokenizer)."""
    return cfg.training.export_final is not False


def final_checkpoint(output_dir: str | os.PathLike, step: int) -> Path:
    """The complete checkpoint of ``step`` (the stage's last), verified."""
    for info in list_checkpoints(output_dir):
        if info.step == step:
            ok, why = verify(info.path)
            if ok:
                return info.path
            raise ExportError(f"{info.path} is {why}; the final export needs the stage's last checkpoint complete")
    raise ExportError(f"{output_dir} holds no checkpoint of step {step}; the final export needs the stage's last "
                      "checkpoint")


def final_status(output_dir: str | os.PathLike, source: Path | None = None) -> tuple[bool, str]:
    """(ok, reason): ``final/`` exists, verifies against its manifest and, when ``source`` is
    given, was exported from exactly that checkpoint (its MANIFEST.json's SHA-256)."""
    final = Path(output_dir) / FINAL_DIR
    if not final.is_dir():
        return False, f"{final} does not exist"
    ok, why = verify_export(final, deep=True)
    if not ok:
        return False, f"{final} is {why}"
    if source is not None:
        try:
            run_doc = json.loads((final / RUN).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return False, f"{final}/{RUN} is unreadable ({exc})"
        if run_doc.get("source_manifest_sha256") != sha256_file(source / MANIFEST):
            return False, f"{final} was exported from {run_doc.get('source_checkpoint')}, not from {source}"
    return True, "ok"


def write_completion(output_dir: str | os.PathLike, *, stage: str, step: int, total_steps: int, source: Path,
                     exported: bool, planned_steps: int | None = None) -> dict[str, Any]:
    """Record that the stage completed (after ``final/``, when it is exported). ``planned_steps``:
    the steps its data holds; ``capped`` says when --max-steps stopped it short of them."""
    out = Path(output_dir)
    final_manifest = out / FINAL_DIR / EXPORT_MANIFEST
    doc = {
        "format": COMPLETE_FORMAT,
        "stage": stage,
        "step": step,
        "total_steps": total_steps,
        "planned_steps": planned_steps,
        "capped": capped_by({"total_steps": total_steps, "planned_steps": planned_steps}),
        "checkpoint": source.relative_to(out).as_posix() if source.is_relative_to(out) else str(source),
        "final": FINAL_DIR if exported else None,
        "final_manifest_sha256": sha256_file(final_manifest) if exported else None,
    }
    earlier = read_completion(out)
    if earlier is not None and {k: earlier.get(k) for k in doc} == doc:
        return earlier  # a finished stage relaunched: the record stands as it was
    doc["completed_unix"] = time.time()
    write_json_atomic(out / COMPLETE_FILE, doc)
    return doc
