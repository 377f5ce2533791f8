"""SFT only: after each epoch checkpoint, ``best/`` and ``selection.json`` under the configured rule."""
from __future__ import annotations

import json

from ds_trhash import checkpoints as ckpt
from ds_trhash.training.callbacks.base import Callback, RunContext, is_epoch_end
from ds_trhash.checkpoints.selection import Candidate, publish
from ds_trhash.training.liveness.phases import CHECKPOINT


class SelectionCallback(Callback):
    """Reads the epoch's evaluation results and checkpoint from the run (so it comes after the
    evaluation and checkpointing callbacks); rank 0 writes."""

    phase = CHECKPOINT

    run_files = ("best", "selection.json")

    def __init__(self, run: RunContext):
        self.run = run
        self.rule = run.cfg.eval.select
        self.candidates: list[Candidate] = []

    @classmethod
    def from_run(cls, run: RunContext) -> "SelectionCallback | None":
        return cls(run) if run.cfg.data.kind == "sft" else None

    def on_start(self, state):
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
        ev, piqa = saved.get("eval") or {}, saved.get("piqa") or {}
        self.candidates.append(Candidate(
            epoch=int(saved["epoch"]), step=state.step, checkpoint=str(checkpoint), eval_loss=ev.get("eval_loss"),
            eval_ppl=ev.get("eval_ppl"), eval_tokens=ev.get("eval_tokens"), train_loss=saved.get("train_loss"),
            piqa_acc=piqa.get("acc"), piqa_acc_norm=piqa.get("acc_norm")))
        winner = publish(run.output_dir, self.candidates, self.rule)
        run.progress.message(f"best/ = epoch {winner.epoch} (step {winner.step}) under rule {self.rule} "
                             f"(epoch {saved['epoch']}'s candidate added from {checkpoint.name} on resume)")

    def on_epoch_end(self, state):
        run = self.run
        if run.rank != 0 or run.last_checkpoint is None:
            return
        ev = run.results["eval"].get(state.step) or {}
        piqa = run.results["piqa"].get(state.step) or {}
        self.candidates.append(Candidate(
            epoch=state.epochs_done, step=state.step, checkpoint=str(run.last_checkpoint),
            eval_loss=ev.get("eval_loss"), eval_ppl=ev.get("eval_ppl"), eval_tokens=ev.get("eval_tokens"),
            train_loss=state.last.get("loss"), piqa_acc=piqa.get("acc"), piqa_acc_norm=piqa.get("acc_norm")))
        winner = publish(run.output_dir, self.candidates, self.rule)
        run.progress.message(f"best/ = epoch {winner.epoch} (step {winner.step}) under rule {self.rule}")
