"""What a training launch is made of: the one place that composes training with evaluation and release.

Training defines the loop and the callback interface; evaluation and release implement callbacks on it;
neither imports the other's upper half. This module, above both, decides which callbacks a
launch gets (every part reads its own config section and stays off when that section says so)
and is what ``launch/train.py`` runs.
"""
from __future__ import annotations

from ds_trhash.eval.callbacks import EVAL_CALLBACKS
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR
from ds_trhash.release.lifecycle.finish import finish_stage
from ds_trhash.training import entrypoint
from ds_trhash.training.callbacks import Callback, RunContext, training_parts
from ds_trhash.training.callbacks.base import TrainState
from ds_trhash.training.signals import StopRequests


class StageEndCallback(Callback):
    """Last: a stage that reached its last step unsignalled gets ``final/``, ``stage_complete.json``
    and its cleanup after success (``release.lifecycle.finish.finish_stage``) on rank 0; every rank waits
    at a barrier, and an error on rank 0 fails the launch after it (so no rank waits forever; the
    checkpoint stays and the next ``RESUME=auto`` launch retries)."""

    run_files = (FINAL_DIR, COMPLETE_FILE)

    def __init__(self, run: RunContext):
        self.run = run

    @classmethod
    def from_run(cls, run: RunContext) -> "StageEndCallback":
        return cls(run)

    def on_end(self, state: TrainState) -> None:
        if state.step != state.total_steps or state.stop_requested:
            return
        run, failure = self.run, None
        if run.rank == 0:
            try:
                finish_stage(run.cfg, run.output_dir, state.step, state.total_steps, log=run.progress.message)
            except Exception as exc:  # re-raised after the barrier
                failure = exc
        run.barrier()
        if failure is not None:
            raise failure


def launch_parts() -> list[type[Callback]]:
    """Every callback class of a launch, in the order the loop calls them: training's with
    evaluation slotted in, then the end of a completed stage (final/, completion, cleanup)."""
    return [*training_parts(evaluation=EVAL_CALLBACKS), StageEndCallback]


def main(argv: list[str] | None = None, requests: StopRequests | None = None) -> int:
    """One launch with every part; ``requests``: the stop-signal recorder ``launch/train.py`` installed."""
    return entrypoint.main(argv, parts=launch_parts(), requests=requests)
