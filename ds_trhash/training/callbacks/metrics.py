"""Training rows of ``metrics.csv``: every ``log_every`` steps, the first and last step, and a stop."""
from __future__ import annotations

from ds_trhash.training.callbacks.base import Callback, RunContext


class MetricsCallback(Callback):
    def __init__(self, writer, model, every: int):
        self.writer, self.model, self.every = writer, model, every

    @classmethod
    def from_run(cls, run: RunContext) -> "MetricsCallback":
        return cls(run.writer, run.model, run.cfg.training.log_every)

    def on_step_end(self, state, metrics):
        if state.step % self.every == 0 or state.step in (1, state.total_steps) or state.stop_requested:
            b = self.model.backends_used()
            self.writer.write(
                step=state.step, epoch=metrics["epoch"], train_loss=metrics["loss"], lr=metrics["lr"],
                tok_s=metrics["tok_s"], tokens_seen=metrics["tokens_seen"],
                supervised_tokens=metrics["supervised_tokens"], label_valid=metrics["label_valid"],
                label_ignored=metrics["label_ignored"], label_out_of_range=metrics["label_out_of_range"],
                experts_backend=b.get("experts"),
                loss_backend=b.get("loss"), norm_backend=b.get("norm"),
            )
