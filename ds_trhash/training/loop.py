"""The model-agnostic training loop.

It knows only an engine (forward / backward / step), a source of micro-batches per optimizer
step, and callbacks. Evaluation, checkpointing, progress and metrics plug in as callbacks, so
the same loop serves pretraining, refinement and SFT.

Loss normalisation: the loss of an optimizer step is the sum of token losses over every
micro-batch on every rank divided by the number of supervised tokens in the whole step (not a
mean of per-micro-batch means). Each micro-batch's summed loss is therefore scaled by
``world_size / n_step`` before backward: DeepSpeed averages gradients over data-parallel ranks,
which removes the ``world_size`` again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.training.callbacks.base import Callback



class StepBatches(Protocol):
    """Where micro-batches come from: a pure function of the step (so resume is exact)."""

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]: ...

    def epoch_of(self, step: int) -> int: ...


@dataclass
class TrainState:
    step: int  # optimizer steps completed
    total_steps: int
    epoch: int = 0  # the epoch being trained, from 0; in on_epoch_end the one just finished
    # epochs completed after ``step`` (0 = the source checkpoint). Every record of an epoch
    # (console, metrics.csv, piqa.jsonl, checkpoints, selection.json) uses this number.
    epochs_done: int = 0
    tokens_seen: int = 0  # input tokens over all ranks
    supervised_seen: int = 0
    stop_requested: bool = False
    last: dict = field(default_factory=dict)  # metrics of the last step


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


class LabelError(ValueError):
    """Labels that no loss can use: training on them would be silently wrong."""


def label_counts(micro_batches: list[dict], vocab_size: int | None) -> tuple[int, int, int]:
    """(valid, ignored, out_of_range) label counts: the sanity columns of metrics.csv."""
    valid = ignored = bad = 0
    for mb in micro_batches:
        labels = mb["labels"]
        is_ignored = labels == IGNORE_INDEX
        in_range = (labels >= 0) & (labels < vocab_size) if vocab_size else labels >= 0
        ignored += int(is_ignored.sum())
        valid += int(in_range.sum())
        bad += int((~is_ignored & ~in_range).sum())
    return valid, ignored, bad


def train_step(engine, micro_batches: list[dict], device: torch.device, world_size: int,
               vocab_size: int | None = None) -> dict:
    """Run one optimizer step over this rank's micro-batches; return step-global statistics."""
    valid, ignored, bad = label_counts(micro_batches, vocab_size)
    t_local = sum(int(mb["input_ids"].numel()) for mb in micro_batches)
    n_step, t_step, ignored_step, bad_step = _all_reduce_sum([valid, t_local, ignored, bad], device)
    if bad_step:
        raise LabelError(
            f"{int(bad_step)} label(s) in this step are neither -100 nor a token id below the vocabulary "
            f"size {vocab_size}; the data does not belong to this model (check the tokenizer and vocabulary)")
    scale = world_size / max(n_step, 1.0)
    loss_sum_local = 0.0
    for mb in micro_batches:
        inputs = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        loss_sum = engine(
            inputs.pop("input_ids"), labels=inputs.pop("labels"), reduction="sum", **inputs
        )
        engine.backward(loss_sum * scale, scale_wrt_gas=False)
        engine.step()
        loss_sum_local += float(loss_sum.detach())
    (loss_total,) = _all_reduce_sum([loss_sum_local], device)
    loss = loss_total / max(n_step, 1.0)
    return {"loss": loss, "supervised_tokens": int(n_step), "tokens": int(t_step),
            "label_valid": int(n_step), "label_ignored": int(ignored_step), "label_out_of_range": int(bad_step)}


def run(
    engine,
    batches: StepBatches,
    state: TrainState,
    callbacks: list[Callback],
    device: torch.device,
    world_size: int,
    lr_of: Callable[[], float],
    vocab_size: int | None = None,
) -> TrainState:
    """Train from ``state.step`` to ``state.total_steps`` (or until a stop is requested)."""
    state.epoch = state.epochs_done = batches.epoch_of(state.step)
    for cb in callbacks:
        cb.on_start(state)
    while state.step < state.total_steps and not state.stop_requested:
        epoch = batches.epoch_of(state.step)
        t0 = time.perf_counter()
        lr = lr_of()
        stats = train_step(engine, batches.micro_batches(state.step), device, world_size, vocab_size)
        dt = time.perf_counter() - t0
        state.step += 1
        state.tokens_seen += stats["tokens"]
        state.supervised_seen += stats["supervised_tokens"]
        next_epoch = state.epochs_done = batches.epoch_of(state.step)
        metrics = {
            "step": state.step,
            "epoch": state.epochs_done,
            "loss": stats["loss"],
            "ppl": math.exp(min(stats["loss"], 50.0)),
            "lr": lr,
            "tok_s": stats["tokens"] / dt if dt > 0 else 0.0,
            "tokens_seen": state.tokens_seen,
            "supervised_tokens": stats["supervised_tokens"],
            "label_valid": stats["label_valid"],
            "label_ignored": stats["label_ignored"],
            "label_out_of_range": stats["label_out_of_range"],
        }
        state.last = metrics
        for cb in callbacks:
            cb.on_step_end(state, metrics)
        if next_epoch != epoch:
            state.epoch = epoch
            for cb in callbacks:
                cb.on_epoch_end(state)
            state.epoch = next_epoch
    for cb in callbacks:
        cb.on_end(state)
    return state
