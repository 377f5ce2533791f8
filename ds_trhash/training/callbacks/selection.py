"""SFT only: after each epoch checkpoint, ``best/`` and ``selection.json`` under the configured rule."""
from __future__ import annotations

import json
from pathlib import Path

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.selection import Candidate, publish
from ds_trhash.training.callbacks.base import (
    Callback,
    EvalResult,
    RunContext,
    StepEvaluation,
    TrainState,
    is_epoch_end,
)
from ds_trhash.training.liveness.phases import CHECKPOINT


def candidate(epoch: int, step: int, checkpoint: Path, heldout: dict | None, piqa: dict | None,
              train_loss: float | None) -> Candidate:
    """One epoch's candidate from its checkpoint and the records of its evaluations (``record()``
    of the results, or what ``trainer_state.json`` kept of them)."""
    ev, pq = heldout or {}, piqa or {}
    return Candidate(epoch=epoch, step=step, checkpoint=str(checkpoint), eval_loss=ev.get("eval_loss"),
                     eval_ppl=ev.get("eval_ppl"), eval_tokens=ev.get("eval_tokens"), train_loss=train_loss,
                     piqa_acc=pq.get("acc"), piqa_acc_norm=pq.get("acc_norm"))


class SelectionCallback(Callback):
    """Takes the epoch's evaluation results (``on_evaluated``) and its checkpoint
    (``on_checkpoint_saved``, sent before ``on_epoch_end`` reaches this callback, which comes after
    the checkpointing one); rank 0 writes."""

    phase = CHECKPOINT

    run_files = ("best", "selection.json")

    def __init__(self, run: RunContext):
        self.run = run
        self.rule = run.cfg.eval.select
        self.candidates: list[Candidate] = []
        self.evaluations: dict[int, StepEvaluation] = {}
        self.checkpoints: dict[int, Path] = {}

    @classmethod
    def from_run(cls, run: RunContext) -> "SelectionCallback | None":
        return cls(run) if run.cfg.data.kind == "sft" else None

    def on_start(self, state: TrainState) -> None:
        """A resumed run keeps the candidates of the epochs it already finished. Resumed at an
        epoch-end checkpoint whose candidate is missing (the run stopped between saving it and
        publishing ``best/``), it adds that candidate from the checkpoint's own record and publishes."""
        run = self.run
        path = run.output_dir / "selection.json"
        if state.step > 0 and path.is_file():
            done = json.loads(path.read_text())["candidates"]
            self.candidates = [Candidate(**c) for c in done if c["step"] <= state.step]
        missing = is_epoch_end(run.loader, state.step) and all(c.step != state.step for c in self.candidates)
        if run.rank != 0 or not missing:
            return
        checkpoint = ckpt.checkpoints_root(run.output_dir) / ckpt.step_dir_name(state.step)
        saved = ckpt.read_trainer_state(checkpoint)
        self.candidates.append(candidate(int(saved["epoch"]), state.step, checkpoint, saved.get("eval"),
                                         saved.get("piqa"), saved.get("train_loss")))
        winner = publish(run.output_dir, self.candidates, self.rule)
        run.progress.message(f"best/ = epoch {winner.epoch} (step {winner.step}) under rule {self.rule} "
                             f"(epoch {saved['epoch']}'s candidate added from {checkpoint.name} on resume)")

    def on_evaluated(self, state: TrainState, result: EvalResult) -> None:
        self.evaluations.setdefault(result.step, StepEvaluation()).add(result)

    def on_checkpoint_saved(self, step: int, path: Path) -> None:
        self.checkpoints[step] = path

    def on_epoch_end(self, state: TrainState) -> None:
        run = self.run
        checkpoint = self.checkpoints.get(state.step)
        measured = self.evaluations.pop(state.step, StepEvaluation())
        if run.rank != 0 or checkpoint is None:
            return
        self.candidates.append(candidate(
            state.epochs_done, state.step, checkpoint, measured.heldout.record() if measured.heldout else None,
            measured.piqa.record() if measured.piqa else None, state.last.get("loss")))
        winner = publish(run.output_dir, self.candidates, self.rule)
        run.progress.message(f"best/ = epoch {winner.epoch} (step {winner.step}) under rule {self.rule}")
