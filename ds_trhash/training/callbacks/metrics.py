"""Training rows of ``metrics.csv``: every ``log_every`` steps, the first and last step, and a stop.

Each row carries the train loss averaged over the steps since the previous row besides the
step's own; the writer passes every row on to DeepSpeed's monitors. At the same steps the
per-expert token routes counted since the previous row go to ``expert_load.csv``, summed over
the ranks (also right before each checkpoint, so that a resume from any checkpoint finds every
route up to its step recorded). On the regular rows the monitors also get peak memory, MFU
(where the device's peak is known) and each expert's share of its layer's routes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ds_trhash.model.flops import train_flops_per_token
from ds_trhash.training.callbacks.base import Callback, Metrics, RunContext, TrainState
from ds_trhash.training.records.expert_load import gather_expert_load, load_shares
from ds_trhash.training.records.files import EXPERT_LOAD_FILE, METRICS_FILE
from ds_trhash.training.records.monitor import IntervalMean, model_flops_utilisation, peak_memory_mib

if TYPE_CHECKING:
    from ds_trhash.model.transformer import TRHashForCausalLM
    from ds_trhash.training.records.expert_load import ExpertLoadWriter
    from ds_trhash.training.records.metrics_csv import MetricsWriter
    from ds_trhash.training.records.monitor import MonitorSink


class MetricsCallback(Callback):
    run_files = (METRICS_FILE, EXPERT_LOAD_FILE)

    def __init__(self, writer: MetricsWriter, model: TRHashForCausalLM, every: int, monitor: MonitorSink | None = None,
                 device: torch.device = torch.device("cpu"), mfu: Callable[[float], float | None] | None = None,
                 expert_load: ExpertLoadWriter | None = None) -> None:
        self.writer, self.model, self.every = writer, model, every
        self.monitor, self.device, self.mfu = monitor, device, mfu  # mfu: tokens/s -> fraction or None
        self.expert_load = expert_load  # training.records.expert_load.ExpertLoadWriter (None: not counted)
        self.interval = IntervalMean()
        self.logged_step = 0  # the step of the previous row: the start of the expert-load interval

    @classmethod
    def from_run(cls, run: RunContext) -> "MetricsCallback":
        cfg, mfu = run.cfg, None
        if run.monitor is not None and run.monitor.enabled:
            flops = train_flops_per_token(run.model_config, cfg.data.seq_len)
            mfu = lambda tok_s: model_flops_utilisation(tok_s, flops, run.world, cfg.precision, run.device)  # noqa: E731
        return cls(run.writer, run.model, cfg.training.log_every, monitor=run.monitor, device=run.device, mfu=mfu,
                   expert_load=run.expert_load)

    def flush_expert_load(self, state: TrainState) -> torch.Tensor | None:
        """The routes counted since the previous row, summed over the ranks (a collective: every
        rank calls this at the same steps), as rows of expert_load.csv; None when nothing is
        counted or this step is already written."""
        monitoring = self.monitor is not None and self.monitor.enabled
        if state.step == self.logged_step or (self.expert_load is None and not monitoring):
            return None
        counts = gather_expert_load(self.model, self.device)
        if counts is not None and self.expert_load is not None:
            self.expert_load.write(state.step, self.logged_step, counts)
        self.logged_step = state.step
        return counts

    def on_start(self, state: TrainState) -> None:
        self.logged_step = state.step

    def before_save(self, state: TrainState) -> None:
        """The expert load counted so far goes to its file first: a resume from any checkpoint
        finds every route up to its step recorded."""
        self.flush_expert_load(state)

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        self.interval.add(loss=metrics["loss"])
        regular = state.step % self.every == 0 or state.step in (1, state.total_steps)
        if not (regular or state.stop_requested):
            return
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
        counts = self.flush_expert_load(state)  # every rank gets here at the same steps (a stop is agreed first)
        if regular and self.monitor is not None and self.monitor.enabled:
            events: dict[str, float | None] = {"Train/peak_memory_mib": peak_memory_mib(self.device)}
            if counts is not None:
                events.update(load_shares(counts))
            if self.mfu is not None:
                events["Train/mfu"] = self.mfu(metrics["tok_s"])
            self.monitor.write(state.step, events)

    def close(self) -> None:
        """The run's record files, flushed and closed; DeepSpeed's monitors flushed."""
        self.writer.close()
        if self.expert_load is not None:
            self.expert_load.close()
        if self.monitor is not None:
            self.monitor.close()
