"""Training rows of ``metrics.csv``: every ``log_every`` steps, the first and last step, and a stop.

Each row carries the train loss averaged over the steps since the previous row besides the
step's own; the writer passes every row on to DeepSpeed's monitors, and on the regular rows the
monitors also get peak memory, MFU (where the device's peak is known) and per-expert token load.
"""
from __future__ import annotations

from ds_trhash.model.flops import train_flops_per_token
from ds_trhash.training.callbacks.base import Callback, RunContext
from ds_trhash.training.monitor import IntervalMean, expert_load, model_flops_utilisation, peak_memory_mib


class MetricsCallback(Callback):
    def __init__(self, writer, model, every: int, monitor=None, device=None, mfu=None):
        self.writer, self.model, self.every = writer, model, every
        self.monitor, self.device, self.mfu = monitor, device, mfu  # mfu: tokens/s -> fraction or None
        self.interval = IntervalMean()

    @classmethod
    def from_run(cls, run: RunContext) -> "MetricsCallback":
        cfg, mfu = run.cfg, None
        if run.monitor is not None and run.monitor.enabled:
            flops = train_flops_per_token(run.model_config, cfg.data.seq_len)
            mfu = lambda tok_s: model_flops_utilisation(tok_s, flops, run.world, cfg.precision, run.device)  # noqa: E731
        return cls(run.writer, run.model, cfg.training.log_every, monitor=run.monitor, device=run.device, mfu=mfu)

    def on_step_end(self, state, metrics):
        self.interval.add(loss=metrics["loss"])
        regular = state.step % self.every == 0 or state.step in (1, state.total_steps)
        if regular or state.stop_requested:
            b = self.model.backends_used()
            self.writer.write(
                step=state.step, epoch=metrics["epoch"], train_loss=metrics["loss"], lr=metrics["lr"],
                tok_s=metrics["tok_s"], tokens_seen=metrics["tokens_seen"],
                supervised_tokens=metrics["supervised_tokens"], label_valid=metrics["label_valid"],
                label_ignored=metrics["label_ignored"], label_out_of_range=metrics["label_out_of_range"],
                experts_backend=b.get("experts"),
                loss_backend=b.get("loss"), norm_backend=b.get("norm"),
                train_loss_avg=self.interval.take()["loss"], grad_norm=metrics.get("grad_norm"),
                step_time=metrics.get("step_time"),
            )
        # regular rows only: every rank takes part in the expert-load all-reduce at the same steps
        if regular and self.monitor is not None and self.monitor.enabled:
            events = {"Train/peak_memory_mib": peak_memory_mib(self.device), **expert_load(self.model, self.device)}
            if self.mfu is not None:
                events["Train/mfu"] = self.mfu(metrics["tok_s"])
            self.monitor.write(state.step, events)
