"""The end of a completed stage: ``final/``, the completion record, cleanup after success.

``finish_stage`` is what rank 0 does once a stage reached its last planned step without a stop
signal (the launch's last callback, composed in ``ds_trhash.run``, calls it; release imports
nothing from training). A stopped stage writes no ``final/``: relaunched with ``RESUME=auto`` it
finishes, then writes it.

``training.cleanup_after_success`` then runs ``release.cleanup`` with its conditions. When they do
not hold yet (typically: the run syncs and the Hub watcher has not verified the last
checkpoints) it deletes nothing and says so; ``ds-trhash sync --watch`` runs the same cleanup
when it has verified everything, and ``ds-trhash cleanup`` runs it by hand.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_trhash.release.cleanup import CleanupRefused, cleanup
from ds_trhash.release.final_export import export_final_enabled, final_checkpoint, write_completion, write_final


def finish_stage(cfg: Any, output_dir: Path, step: int, total_steps: int, log: Callable[[str], None]) -> None:
    """``final/`` (when ``training.export_final``), then ``stage_complete.json``, then cleanup.
    ``cfg``: the launch's TrainConfig (stage, data.kind, training.*)."""
    source = final_checkpoint(output_dir, step)
    exported = export_final_enabled(cfg)
    if exported:
        write_final(output_dir, source, log=log)
    write_completion(output_dir, stage=cfg.stage, step=step, total_steps=total_steps, source=source,
                     exported=exported)
    mode = cfg.training.cleanup_after_success
    if mode != "off":
        try:
            report = cleanup(output_dir, mode, log=log)
            log(f"cleanup after success ({mode}): removed {len(report.removed)} checkpoint(s)")
        except CleanupRefused as exc:
            log(f"cleanup after success deferred: {exc}; `ds-trhash sync --watch` cleans up once it has "
                f"verified them, or run `ds-trhash cleanup {output_dir} --keep {mode.removeprefix('keep_')}`")
