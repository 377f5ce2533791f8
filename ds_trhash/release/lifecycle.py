"""The last callback of a launch: a completed stage's ``final/``, completion record and cleanup.

Composed by ``ds_trhash.run`` after training's own callbacks (the training package never imports
release), so it runs once the stage's last checkpoint is written. Only a stage that reached its
last planned step and was not stopped by a signal gets here with work to do: a stopped stage
writes no ``final/`` (relaunched with ``RESUME=auto`` it finishes, then writes it). Rank 0 does the
work; every rank waits at a barrier after it, and an error on rank 0 fails the launch after the
barrier (the checkpoint stays; the next ``RESUME=auto`` launch retries).

``training.cleanup_after_success`` then runs ``release.cleanup`` with its conditions. When they do
not hold yet (typically: the run syncs and the Hub watcher has not verified the last
checkpoints) it deletes nothing and says so; ``ds-trhash sync --watch`` runs the same cleanup
when it has verified everything, and ``ds-trhash cleanup`` runs it by hand.
"""
from __future__ import annotations

from ds_trhash.release.cleanup import CleanupRefused, cleanup
from ds_trhash.release.final_export import export_final_enabled, final_checkpoint, write_completion, write_final
from ds_trhash.training.callbacks.base import Callback, RunContext


class StageEndCallback(Callback):
    def __init__(self, run: RunContext):
        self.run = run

    @classmethod
    def from_run(cls, run: RunContext) -> "StageEndCallback":
        return cls(run)

    def on_end(self, state) -> None:
        if state.step != state.total_steps or state.stop_requested:
            return
        run = self.run
        failure: BaseException | None = None
        if run.rank == 0:
            try:
                self.finish(state)
            except Exception as exc:  # re-raised after the barrier, so no rank waits for rank 0 forever
                failure = exc
        run.barrier()
        if failure is not None:
            raise failure

    def finish(self, state) -> None:
        run, say = self.run, self.run.progress.message
        out = run.output_dir
        source = final_checkpoint(out, state.step)
        exported = export_final_enabled(run.cfg)
        if exported:
            write_final(out, source, log=say)
        write_completion(out, stage=run.cfg.stage, step=state.step, total_steps=state.total_steps, source=source,
                         exported=exported)
        mode = run.cfg.training.cleanup_after_success
        if mode != "off":
            try:
                report = cleanup(out, mode, log=say)
                say(f"cleanup after success ({mode}): removed {len(report.removed)} checkpoint(s)")
            except CleanupRefused as exc:
                say(f"cleanup after success deferred: {exc}; `ds-trhash sync --watch` cleans up once it has "
                    f"verified them, or run `ds-trhash cleanup {out} --keep {mode.removeprefix('keep_')}`")


LIFECYCLE_CALLBACKS = (StageEndCallback,)
