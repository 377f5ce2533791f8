"""The end of a completed stage: ``final/``, the completion record, cleanup after success.

``finish_stage`` is what rank 0 does once a stage reached its last planned step without a stop
signal (the launch's last callback, composed in ``ds_trhash.run``, calls it; release imports
nothing from training). A stopped stage writes no ``final/``: relaunched with ``RESUME=auto`` it
finishes, then writes it.

``training.cleanup_after_success`` then runs ``release.lifecycle.cleanup`` with its conditions. When they do
not hold yet (typically: the run syncs and the Hub watcher has not verified the last
checkpoints) it deletes nothing and says so; ``ds-trhash sync --watch`` runs the same cleanup
when it has verified everything, and ``ds-trhash cleanup`` runs it by hand.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints import read_trainer_state
from ds_trhash.release.export.manifest import EXPORT_MANIFEST
from ds_trhash.release.export.writer import export_checkpoint
from ds_trhash.release.lifecycle.cleanup import CleanupRefused, cleanup
from ds_trhash.release.lifecycle.final import (FINAL_DIR, Log, StageSettings, export_final_enabled, final_checkpoint, final_status,
                                               write_completion)


def _set_aside(path: Path, log: Log) -> None:
    aside = path.with_name(f"{path.name}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(path, aside)
    log(f"set {path.name}/ aside as {aside.name}/ (kept for inspection) before writing it again")


def write_final(output_dir: str | os.PathLike, source: Path, log: Log = print) -> dict[str, Any]:
    """Export ``source`` to ``<output_dir>/final/`` unless a verified export of it is there;
    returns the export's manifest."""
    out = Path(output_dir)
    final = out / FINAL_DIR
    for leftover in out.glob(f".{FINAL_DIR}.tmp-*"):  # an export killed half-way (never renamed in)
        shutil.rmtree(leftover, ignore_errors=True)
    if final.exists():
        ok, why = final_status(out, source)
        if ok:
            log(f"{final} already holds the verified export of {source.name}; kept")
            return json.loads((final / EXPORT_MANIFEST).read_text(encoding="utf-8"))
        log(f"{why}")
        _set_aside(final, log)
    manifest = export_checkpoint(source, final)
    log(f"final export of {source.name} -> {final}: {manifest['weights']['tensors']} tensors, "
        f"sha256 {manifest['weights']['sha256']} (tensor round trip verified)")
    return manifest


def finish_stage(cfg: StageSettings, output_dir: Path, step: int, total_steps: int, log: Callable[[str], None]) -> None:
    """``final/`` (when ``training.export_final``), then ``stage_complete.json``, then cleanup.
    ``cfg``: the launch's TrainConfig (stage, data.kind, training.*)."""
    source = final_checkpoint(output_dir, step)
    exported = export_final_enabled(cfg)
    if exported:
        write_final(output_dir, source, log=log)
    write_completion(output_dir, stage=cfg.stage, step=step, total_steps=total_steps, source=source,
                     exported=exported, planned_steps=read_trainer_state(source).get("planned_steps"))
    mode = cfg.training.cleanup_after_success
    if mode != "off":
        try:
            report = cleanup(output_dir, mode, log=log)
            log(f"cleanup after success ({mode}): removed {len(report.removed)} checkpoint(s)")
        except CleanupRefused as exc:
            log(f"cleanup after success deferred: {exc}; `ds-trhash sync --watch` cleans up once it has "
                f"verified them, or run `ds-trhash cleanup {output_dir} --keep {mode.removeprefix('keep_')}`")
