"""The model-agnostic training loop.

It knows only an engine (forward / backward / step), a data loader (``data.stage.DataLoader``:
micro-batches per optimizer step), and callbacks. Evaluation, checkpointing, progress and
metrics plug in as callbacks, so the same loop serves pretraining, refinement and SFT.

Loss normalisation: the loss of an optimizer step is the sum of token losses over every
micro-batch on every rank divided by the number of supervised tokens in the whole step (not a
mean of per-micro-batch means). Each micro-batch's summed loss is therefore scaled by
``world_size / n_step`` before backward: DeepSpeed averages gradients over data-parallel ranks,
which removes the ``world_size`` again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.errors import UserError
from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.ranks import is_multi_rank
from ds_trhash.training.callbacks.base import Callback, Metrics, TrainState  # the loop's names too
from ds_trhash.data.stage import DataLoader
from ds_trhash.training.liveness.phases import (
    DATA_WAIT, END, FIRST_STEP, FORWARD_BACKWARD, HOOKS, MARK_DATA, MARK_END, MARK_FORWARD, MARK_OPTIMIZER,
    OPTIMIZER, Beacon)
from ds_trhash.training.nonfinite import NonFiniteGuard, is_finite, skip_update

log = logging.getLogger("ds_trhash.loop")


_HOST_GROUP: dist.ProcessGroup | None = None


def _host_group() -> dist.ProcessGroup | None:
    """A gloo group for the integer counts, which come from host-side batches: reducing them on
    the CPU keeps the accelerator stream free of host synchronisation (NCCL would need a device
    tensor and a copy back). On a gloo default group (CPU runs) it is that group."""
    global _HOST_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def _all_reduce_counts(values: list[int], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[int]:
    """Sum (or ``op``) host integers over ranks (gloo, CPU tensors): no device involved."""
    if not is_multi_rank():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=op, group=_host_group())
    return [int(v) for v in t]


def _min_over_ranks(value: int) -> int:
    return _all_reduce_counts([value], op=dist.ReduceOp.MIN)[0]


class LabelError(UserError, ValueError):
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


def _reduced_grad_norm(engine: DeepSpeedEngine) -> torch.Tensor | None:
    """The global gradient norm before clipping, where DeepSpeed does not keep one.

    ZeRO 1/2 and the bf16/fp16 optimizers record it (``get_global_grad_norm``); plain ZeRO 0
    fp32 clips through ``clip_grad_norm_`` and drops the value. There, after the last backward
    of the step the gradients are already averaged over the data-parallel ranks, so their norm
    here is the global one.
    """
    if hasattr(getattr(engine, "optimizer", None), "_global_grad_norm") or not hasattr(engine, "module"):
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def train_step(engine: DeepSpeedEngine, micro_batches: list[dict], device: torch.device, world_size: int,
               vocab_size: int | None = None, skip_nonfinite: bool = False,
               beacon: Beacon | None = None) -> dict:
    """Run one optimizer step over this rank's micro-batches; return step-global statistics.

    No host synchronisation: label counts are host integers (summed over ranks on the CPU), the
    loss is accumulated on the device over micro-batches and all-reduced there; ``"loss"`` is a
    0-dim device tensor that reaches the host only when someone reads it (``float(...)``),
    which the loop leaves to the callbacks that log it. ``skip_nonfinite`` (training.nonfinite
    skip_step) reads the step's loss and gradient norm before the optimizer applies them, and a
    non-finite step becomes a no-op update (``"skipped"`` True). ``beacon``: where the liveness
    heartbeat reads this rank's place (the optimizer's part is marked; a first step keeps its phase).
    """
    valid, ignored, bad = label_counts(micro_batches, vocab_size)
    t_local = sum(int(mb["input_ids"].numel()) for mb in micro_batches)
    n_step, t_step, ignored_step, bad_step = _all_reduce_counts([valid, t_local, ignored, bad])
    if bad_step:
        raise LabelError(
            f"{int(bad_step)} label(s) in this step are neither -100 nor a token id below the vocabulary "
            f"size {vocab_size}; the data does not belong to this model (check the tokenizer and vocabulary)")
    scale = world_size / max(n_step, 1)
    skipped = False
    # float64, as the host sum of float(loss) per micro-batch was: metrics.csv values unchanged
    loss_sum_local = torch.zeros((), dtype=torch.float64, device=device)
    own_norm = None
    for i, mb in enumerate(micro_batches):
        inputs = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        loss_sum = engine(
            inputs.pop("input_ids"), labels=inputs.pop("labels"), reduction="sum", **inputs
        )
        engine.backward(loss_sum * scale, scale_wrt_gas=False)
        loss_sum_local += loss_sum.detach().double()
        if i == len(micro_batches) - 1:
            if beacon is not None:
                beacon.mark = MARK_OPTIMIZER
                beacon.phase = beacon.phase if beacon.phase == FIRST_STEP else OPTIMIZER
            own_norm = _reduced_grad_norm(engine)
            if skip_nonfinite:  # decided before the update, alike on every rank (global values)
                if is_multi_rank():
                    dist.all_reduce(loss_sum_local)
                skipped = not is_finite(loss_sum_local, own_norm)
                if skipped:
                    skip_update(engine)
        engine.step()
    if is_multi_rank() and not skip_nonfinite:
        dist.all_reduce(loss_sum_local)  # on the device stream: nothing waits for it here
    loss = loss_sum_local / max(n_step, 1)
    # a device tensor (or DeepSpeed's float): read on the host only when a callback logs it
    norm = own_norm if own_norm is not None else getattr(engine, "get_global_grad_norm", lambda: None)()
    return {"loss": loss, "grad_norm": norm, "supervised_tokens": n_step, "tokens": t_step,
            "label_valid": n_step, "label_ignored": ignored_step, "label_out_of_range": bad_step,
            "skipped": skip_nonfinite and skipped}


class StepMetrics(Mapping[str, Any]):
    """One step's metrics for the callbacks; ``loss``, ``ppl`` and ``grad_norm`` come from device
    tensors and are copied to the host on first access only (the metrics, progress and monitor
    callbacks read them at logging steps), so steps that log nothing never wait for the device."""

    _LAZY = ("loss", "ppl", "grad_norm")

    def __init__(self, values: dict, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None,
                 first_nonfinite: torch.Tensor | None = None):
        self._values = dict(values)
        self._loss = loss
        self._grad_norm = grad_norm
        self._first_nonfinite = first_nonfinite  # the guard's device tensor, read with the loss
        self.first_nonfinite: int | None = None  # after the read: the first non-finite step, or -1

    def _resolve(self) -> None:
        if "loss" not in self._values:
            loss, g, bad = self._loss, self._grad_norm, self._first_nonfinite
            if isinstance(loss, torch.Tensor):
                # everything on the device in one copy to the host, not one each
                parts = [loss.detach().double().reshape(())]
                parts += [g.detach().double().reshape(()).to(parts[0].device)] if isinstance(g, torch.Tensor) else []
                parts += [bad.double().reshape(()).to(parts[0].device)] if bad is not None else []
                values = torch.stack(parts).tolist() if len(parts) > 1 else [parts[0]]
                loss = values[0]
                g = values[1] if isinstance(g, torch.Tensor) else g
                self.first_nonfinite = int(values[-1]) if bad is not None else None
            loss = float(loss)
            self._values["loss"] = loss
            self._values["ppl"] = math.exp(min(loss, 50.0))
            self._values["grad_norm"] = None if g is None else float(g)
            self._loss, self._grad_norm, self._first_nonfinite = 0.0, None, None  # the device tensors let go

    def __getitem__(self, key: str) -> Any:  # Any: the metric's number (or None: not measured)
        if key in self._LAZY:
            self._resolve()
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter((*self._values.keys(), *(k for k in self._LAZY if k not in self._values)))

    def __len__(self) -> int:
        return len(set(self._values) | set(self._LAZY))


def run(
    engine: DeepSpeedEngine,
    loader: DataLoader,
    state: TrainState,
    callbacks: list[Callback],
    device: torch.device,
    world_size: int,
    lr_of: Callable[[], float],
    vocab_size: int | None = None,
    nonfinite: NonFiniteGuard | None = None,
    beacon: Beacon | None = None,
) -> TrainState:
    """Train from ``state.step`` to ``state.total_steps`` (or until a stop is requested).

    Whatever happens, every callback's ``close`` runs, in call order. An exception from a step
    or a hook is first passed to every ``on_error``, then re-raised; a ``close`` that fails
    meanwhile is logged and does not hide it. After a stage that ended, the first failed
    ``close`` is raised once every other callback is closed. ``nonfinite``: the divergence guard
    (training/nonfinite.py), checked at its check steps with the loss read and before each save
    (the trainer hooks it there). ``beacon``: this rank's liveness beacon (training/liveness/), set
    at each place of a step (attribute writes only)."""
    failed = False
    if nonfinite is not None:
        nonfinite.agree = _min_over_ranks
    try:
        return _train(engine, loader, state, callbacks, device, world_size, lr_of, vocab_size, nonfinite,
                      beacon or Beacon())
    except BaseException as exc:
        failed = True
        for cb in callbacks:
            cb.on_error(exc)
        raise
    finally:
        _close_all(callbacks, raise_first=not failed)


def _close_all(callbacks: list[Callback], raise_first: bool) -> None:
    errors = []
    for cb in callbacks:
        try:
            cb.close()
        except Exception as exc:  # every other callback still releases what it holds
            errors.append(exc)
            log.error("closing %s failed", type(cb).__name__, exc_info=exc)
    if errors and raise_first:
        raise errors[0]


def _hooks(callbacks: list[Callback], hook: str, state: TrainState, beacon: Beacon, first_mark: int,
           *args: Metrics, phase: str | None = None) -> None:
    """Call ``hook`` on every callback, the beacon at each one's place (its ``phase``, or ``phase``)."""
    for i, cb in enumerate(callbacks):
        beacon.at(state.step, first_mark + i, phase or cb.phase)
        getattr(cb, hook)(state, *args)


def _train(engine: DeepSpeedEngine, loader: DataLoader, state: TrainState, callbacks: list[Callback], device: torch.device,
           world_size: int, lr_of: Callable[[], float], vocab_size: int | None,
           guard: NonFiniteGuard | None, beacon: Beacon) -> TrainState:
    """The steps and the hooks of a stage (``run`` puts the lifecycle around them)."""
    state.epoch = state.epochs_done = loader.epoch_of(state.step)
    for i, cb in enumerate(callbacks):
        if state.stop_requested:  # agreed before the first step (the stop callback comes first): no
            break  # evaluation of the starting point, no profiler; every on_end still runs
        beacon.at(state.step, HOOKS + i, cb.phase)
        cb.on_start(state)
    state.throughput.start()
    while state.step < state.total_steps and not state.stop_requested:
        epoch = loader.epoch_of(state.step)
        t0 = time.perf_counter()
        lr = lr_of()
        beacon.at(state.step + 1, MARK_DATA, DATA_WAIT)
        batches = loader.micro_batches(state.step)
        beacon.at(state.step + 1, MARK_FORWARD, FIRST_STEP if state.steps_timed == 0 else FORWARD_BACKWARD)
        stats = train_step(engine, batches, device, world_size, vocab_size,
                           skip_nonfinite=guard is not None and guard.skips, beacon=beacon)
        dt = time.perf_counter() - t0
        state.step += 1
        state.step_seconds += dt
        state.steps_timed += 1
        if guard is not None:
            if guard.skips:
                guard.skipped_step(state.step, stats["skipped"])
            else:
                guard.record(state.step, stats["loss"], stats["grad_norm"])
        state.tokens_seen += stats["tokens"]
        state.supervised_seen += stats["supervised_tokens"]
        next_epoch = state.epochs_done = loader.epoch_of(state.step)
        metrics = StepMetrics({
            "step": state.step,
            "epoch": state.epochs_done,
            "lr": lr,
            "tok_s": stats["tokens"] / dt if dt > 0 else 0.0,
            "step_time": dt,
            "tokens_seen": state.tokens_seen,
            "supervised_tokens": stats["supervised_tokens"],
            "label_valid": stats["label_valid"],
            "label_ignored": stats["label_ignored"],
            "label_out_of_range": stats["label_out_of_range"],
        }, loss=stats["loss"], grad_norm=stats["grad_norm"], first_nonfinite=guard.first_bad if guard else None)
        if guard is not None and guard.due(state.step, state.total_steps):
            metrics["loss"]  # the one host read of a logging step: loss, grad norm and the guard together
            guard.check(metrics.first_nonfinite)  # before any callback could save this step
        state.last = metrics
        _hooks(callbacks, "on_step_end", state, beacon, HOOKS, metrics)
        if next_epoch != epoch:
            state.epoch = epoch
            _hooks(callbacks, "on_epoch_end", state, beacon, HOOKS + len(callbacks))
            state.epoch = next_epoch
        state.throughput.note(state.step, stats["tokens"], state.pauses)  # the step and its callbacks
        state.pauses.clear()
    _hooks(callbacks, "on_end", state, beacon, MARK_END, phase=END)
    return state
