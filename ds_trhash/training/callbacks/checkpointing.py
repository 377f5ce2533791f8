"""Crash-safe checkpoints at the configured cadence, token-pack boundaries, epoch ends, on a
stop signal and at the end of the stage; old ones rotated away."""
from __future__ import annotations

from pathlib import Path

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.background import BackgroundSaver, Finished, PendingFile
from ds_trhash.training.callbacks.base import (Callback, EvalResult, Metrics, RunContext, StepEvaluation, TrainState,
                                              is_epoch_end)
from ds_trhash.training.checkpoint_capture import capturing
from ds_trhash.training.checkpoint_plan import cadence_reason
from ds_trhash.training import liveness
from ds_trhash.training.liveness.phases import CHECKPOINT


class CheckpointCallback(Callback):
    """Saves through ``ds_trhash.checkpoints.background`` (collective: every rank calls it).

    The step pays for the engine's state copied to host memory; a thread per rank writes,
    hashes and publishes it (``BackgroundSaver``), one save at a time: a save first finishes the
    one in flight. A finished save is noticed at the next step (its failure raised there), then
    rotated and reported. An epoch-end step is saved by ``on_epoch_end`` (after the evaluation
    callbacks ran, so its record holds their results), never twice, and waited for, since
    selection links ``best/`` to it; the end of the stage, a stop, ``flush`` and ``close`` wait
    for the save in flight too. Each completed checkpoint is told to every callback
    (``on_checkpoint_saved(step, path)``); the evaluation results an epoch checkpoint records
    come from ``on_evaluated``.
    The kernel path a checkpoint records is the one of the last training step (taken in
    ``on_step_end``, before any evaluation forward of that step's epoch end can overwrite it).
    Rotation takes the output directory's sync lock and, while a Hub sync holds it, waits for
    the next checkpoint; with ``checkpoint.keep_unsynced`` it keeps what no sync verified yet.
    """

    phase = CHECKPOINT

    def __init__(self, run: RunContext):
        self.run = run
        self.every = run.cfg.checkpoint.every_steps
        self.keep_last = run.cfg.checkpoint.keep_last
        self.protect = set(run.protect_steps)
        self.last_saved = -1
        self.kernel_path: dict | None = None  # backends_used() after the last training step
        self.capture = capturing(run.engine)
        # never published once liveness is unhealthy (a rank lost, or this one was frozen)
        self.saver = BackgroundSaver(run.rank, run.world, after_write=self._fault_point,
                                     may_publish=lambda: liveness.current().publish_refusal())
        self.reasons: dict[int, str] = {}
        self.evaluations: dict[int, StepEvaluation] = {}  # by step, for the epoch checkpoint's record

    @classmethod
    def from_run(cls, run: RunContext) -> "CheckpointCallback":
        return cls(run)

    def _fault_point(self, step: int) -> None:
        if self.run.faults is not None:  # the crash-safety tests: killed mid-write, in the thread
            self.run.faults.maybe_kill("kill_during_save", step)

    def save(self, state: TrainState, reason: str, extra: dict | None = None, *, wait: bool = False) -> None:
        if state.step == self.last_saved:
            return
        state.pause("checkpoint")  # this step's interval stays out of the steady tokens/s
        run = self.run
        self.wait()  # one save at a time; the finished one is rotated before the next starts
        run.before_save(state)  # e.g. the expert load counted so far goes to its file first

        def capture(tmp: Path) -> list[PendingFile]:
            run.engine.save_checkpoint(str(tmp), tag=ckpt.ENGINE_TAG)
            return self.capture.take() if self.capture is not None else []

        self.saver.start(
            run.output_dir, state.step, capture=capture,
            trainer_state=run.trainer_state(state, reason, {**self._trained_with(), **(extra or {})}),
            barrier=run.barrier,
        )
        self.last_saved = state.step
        self.reasons[state.step] = reason
        if wait:
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight (raising its failure), then rotate and report it."""
        self._finished(self.saver.wait())

    def flush(self) -> None:
        self.wait()

    def _finished(self, done: Finished | None) -> None:
        if done is None:
            return
        run = self.run
        if run.rank == 0 and self.keep_last:
            ckpt.rotate_unless_syncing(run.output_dir, self.keep_last, protect=self.protect, log=run.progress.message,
                                       keep_unsynced=run.cfg.checkpoint.keep_unsynced)
        run.progress.message(f"checkpoint {done.path.name} ({self.reasons.pop(done.step, 'saved')}, "
                             f"{done.on_step_s:.1f}s on the step, {done.background_s:.1f}s written in the background)")
        run.checkpoint_saved(done.step, done.path)

    def _trained_with(self) -> dict:
        return {"backends_used": self.kernel_path} if self.kernel_path is not None else {}

    def on_start(self, state: TrainState) -> None:
        if state.step > 0:  # a resume starts from a complete checkpoint of this step: never saved again
            self.last_saved = state.step

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        self._finished(self.saver.poll())  # a background failure surfaces here, at the next step
        self.kernel_path = self.run.model.backends_used()  # the training step's forward was the last one
        if is_epoch_end(self.run.loader, state.step):
            return
        reason = "stop signal" if state.stop_requested else cadence_reason(state.step, self.every, self.protect)
        if reason:
            self.save(state, reason)

    def on_evaluated(self, state: TrainState, result: EvalResult) -> None:
        self.evaluations.setdefault(result.step, StepEvaluation()).add(result)

    def on_epoch_end(self, state: TrainState) -> None:
        self.protect.add(state.step)
        measured = self.evaluations.pop(state.step, StepEvaluation())
        self.save(state, f"end of epoch {state.epochs_done}",
                  {"eval": measured.heldout.record() if measured.heldout else None,
                   "piqa": measured.piqa.record() if measured.piqa else None,
                   "train_loss": state.last.get("loss") if state.last else None}, wait=True)

    def on_end(self, state: TrainState) -> None:
        if state.step == state.total_steps:
            self.save(state, "final")
        self.wait()

    def close(self) -> None:
        """Every way out of the stage (an error too) lets the save in flight finish."""
        self.wait()
