"""The trainer's events, sent to DeepSpeed's monitors (TensorBoard, CSV, Weights & Biases, Comet).

DeepSpeed builds a ``MonitorMaster`` from the ``tensorboard`` / ``csv_monitor`` / ``wandb`` /
``comet`` entries of its config (our ``deepspeed:`` section) and keeps it as ``engine.monitor``;
on its own it logs only the learning rate by sample count. Here every row of ``metrics.csv``
(train loss, its average over the logging interval, learning rate, grad norm, tokens/s, step
time; held-out loss) and the events that do not fit a CSV row (peak memory, MFU where the FLOPs
are known, each expert's share of its layer's token routes, see ``expert_load``) are written to it
as ``(name, value, step)`` with the optimizer step as x axis. Nothing happens when no monitor is
enabled.
"""
from __future__ import annotations

import math
import resource
from typing import Any, Mapping, Protocol, cast

import torch

from ds_trhash.model.flops import nominal_bf16_tflops

__all__ = ["MonitorSink", "IntervalMean", "peak_memory_mib", "model_flops_utilisation"]

# metrics.csv column -> monitor event name
EVENT_NAMES = {
    "train_loss": "Train/loss", "train_loss_avg": "Train/loss_interval_mean", "lr": "Train/lr",
    "grad_norm": "Train/grad_norm", "tok_s": "Train/tokens_per_s", "step_time": "Train/step_time_s",
    "eval_loss": "Eval/loss", "eval_ppl": "Eval/ppl",
}


class EventWriter(Protocol):
    """What is used of DeepSpeed's MonitorMaster (untyped): a batch of (name, value, step)."""

    def write_events(self, events: list[tuple[str, float, int]]) -> None: ...


class MonitorSink:
    """Writes events to DeepSpeed's MonitorMaster (rank 0 writes; the others hold no writers)."""

    def __init__(self, ds_monitor: object) -> None:
        enabled = ds_monitor is not None and getattr(ds_monitor, "enabled", False)
        self.monitor = cast(EventWriter, ds_monitor) if enabled else None

    @property
    def enabled(self) -> bool:
        return self.monitor is not None

    def write(self, step: int, events: Mapping[str, float | None]) -> None:
        if self.monitor is None:
            return
        batch = [(name, float(v), int(step)) for name, v in events.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if batch:
            self.monitor.write_events(batch)

    def close(self) -> None:
        """Flush what DeepSpeed's TensorBoard writer holds; later writes go nowhere."""
        tensorboard = getattr(self.monitor, "tb_monitor", None)
        if tensorboard is not None:
            tensorboard.flush()
        self.monitor = None

    def row(self, step: int, row: Mapping[str, Any]) -> None:
        """A metrics.csv row (``MetricsWriter(on_row=...)``)."""
        self.write(step, {EVENT_NAMES[k]: v for k, v in row.items() if k in EVENT_NAMES})


class IntervalMean:
    """Means of per-step values since the last logged row (train loss, step time)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.count += 1

    def take(self) -> dict[str, float]:
        out = {k: v / self.count for k, v in self.sums.items()} if self.count else {}
        self.sums, self.count = {}, 0
        return out


def peak_memory_mib(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process, else its peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def model_flops_utilisation(tokens_per_s: float, flops_per_token: float, world_size: int,
                            precision: str, device: torch.device) -> float | None:
    """Achieved model FLOP/s per device over the device's nominal bf16 peak; None where that
    peak is not known (CPU, unknown GPUs, other precisions)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    peak = nominal_bf16_tflops(torch.cuda.get_device_name(device))
    if not peak:
        return None
    return tokens_per_s * flops_per_token / world_size / (peak * 1e12)

