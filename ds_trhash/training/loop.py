"""The model-agnostic training loop.

It knows only an engine (forward / backward / step), a data loader (``data.stage.DataLoader``:
micro-batches per optimizer step), and callbacks. Evaluation, checkpointing, progress and
metrics plug in as callbacks, so the same loop serves pretraining, refinement and SFT.

Loss normalisation: the loss of an optimizer step is the sum of token losses over every
micro-batch on every rank divided by the number of supervised tokens in the whole step (not a
mean of per-micro-batch means). Each micro-batch's summed loss is therefore scaled by
``world_size / n_step`` before backward: DeepSpeed averages gradients over data-parallel ranks,
which removes the ``world_size`` again.

One decision point per step, after the backwards and before the update (``decide_together``):
every callback's ``before_update`` vote (the non-finite guard's skip_step; a rank's
out-of-memory error votes to retry), the largest over the ranks in one small host all-reduce
(gloo, CPU integers: no device synchronisation). A retried step is trained again on the same rows
at a smaller micro-batch (``agreed_step``; training/memory/).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from ds_trhash.data.stage import DataLoader
from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.errors import UserError
from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.ranks import host_all_reduce, is_multi_rank
from ds_trhash.training.callbacks.base import (  # the loop's names too
    GO_ON,
    RETRY,
    SKIP_UPDATE,
    Callback,
    FaultPoints,
    Metrics,
    TrainState,
    UpdateCheck,
)
from ds_trhash.training.memory.sizes import MicroBatches, recut, rows_of, smaller_micro_batch
from ds_trhash.training.memory.step import (
    MicroBatchFloor,
    OutOfMemoryExit,
    abandon_step,
    deferred_boundary,
    match_engine,
    raise_out_of_memory,
    reduce_at_boundary,
    retries_in_place,
    why_not_in_place,
)
from ds_trhash.training.liveness.phases import (
    DATA_WAIT, END, FIRST_STEP, FORWARD_BACKWARD, HOOKS, MARK_DATA, MARK_END, MARK_FORWARD, MARK_OPTIMIZER,
    OPTIMIZER, Beacon)

log = logging.getLogger("ds_trhash.loop")


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


def train_step(engine: DeepSpeedEngine, micro_batches: MicroBatches, device: torch.device, world_size: int,
               vocab_size: int | None = None, decide: Callable[[UpdateCheck], int] | None = None,
               step: int = 0, inject_oom: Callable[[int], bool] | None = None,
               beacon: Beacon | None = None) -> dict:
    """Run one optimizer step over this rank's micro-batches; return step-global statistics.

    No host synchronisation: label counts are host integers (summed over ranks on the CPU), the
    loss is accumulated on the device over micro-batches and all-reduced there; ``"loss"`` is a
    0-dim device tensor that reaches the host only when someone reads it (``float(...)``),
    which the loop leaves to the callbacks that log it.

    ``decide``: the step's one decision point, after the backwards and before the update (the
    loop's callbacks' ``before_update`` votes agreed over the ranks): ``SKIP_UPDATE`` makes the
    update a no-op (``"decision"``), ``RETRY`` abandons the step (nothing applied; the caller
    trains it again). Where the ranks can retry in place (``memory.step.retries_in_place``) the
    boundary's gradient reduction waits for that decision, so that a rank out of memory reaches
    it like the others; elsewhere an out-of-memory error propagates. ``inject_oom(micro_step)``:
    the fault injection's out-of-memory error inside that micro-batch's backward. ``beacon``: where
    the liveness heartbeat reads this rank's place (the decision and the update are marked; a first
    step keeps its phase).
    """
    valid, ignored, bad = label_counts(micro_batches, vocab_size)
    t_local = sum(int(mb["input_ids"].numel()) for mb in micro_batches)
    n_step, t_step, ignored_step, bad_step = host_all_reduce([valid, t_local, ignored, bad])
    if bad_step:
        raise LabelError(
            f"{int(bad_step)} label(s) in this step are neither -100 nor a token id below the vocabulary "
            f"size {vocab_size}; the data does not belong to this model (check the tokenizer and vocabulary)")
    scale = world_size / max(n_step, 1)
    # float64, as the host sum of float(loss) per micro-batch was: metrics.csv values unchanged
    loss_sum_local = torch.zeros((), dtype=torch.float64, device=device)
    match_engine(engine, len(micro_batches), int(micro_batches[0]["input_ids"].shape[0]))
    in_place, micro_steps = retries_in_place(engine), getattr(engine, "micro_steps", 0)
    with deferred_boundary(engine, in_place):
        failed = _backwards(engine, micro_batches, device, scale, loss_sum_local, in_place, inject_oom)
        if beacon is not None:  # the decision point and the update: the optimizer's part of the step
            beacon.mark = MARK_OPTIMIZER
            beacon.phase = beacon.phase if beacon.phase == FIRST_STEP else OPTIMIZER
        check = UpdateCheck(step, loss_sum_local, lambda: _reduced_grad_norm(engine), failed,
                            micro_batch=int(micro_batches[0]["input_ids"].shape[0]), rows=rows_of(micro_batches))
        decision = decide(check) if decide is not None else (RETRY if failed else GO_ON)
        if decision == RETRY:
            abandon_step(engine, micro_steps)
            return {"decision": RETRY, "check": check}
        if in_place:
            reduce_at_boundary(engine)
        own_norm = _reduced_grad_norm(engine)
        if decision == SKIP_UPDATE:
            skip_update(engine)
        engine.step()
    if is_multi_rank():
        dist.all_reduce(loss_sum_local)  # on the device stream: nothing waits for it here
    loss = loss_sum_local / max(n_step, 1)
    # a device tensor (or DeepSpeed's float): read on the host only when a callback logs it
    norm = own_norm if own_norm is not None else getattr(engine, "get_global_grad_norm", lambda: None)()
    return {"loss": loss, "grad_norm": norm, "supervised_tokens": n_step, "tokens": t_step,
            "label_valid": n_step, "label_ignored": ignored_step, "label_out_of_range": bad_step,
            "decision": decision, "check": check}


def _backwards(engine: DeepSpeedEngine, micro_batches: MicroBatches, device: torch.device, scale: float, loss_sum_local: torch.Tensor,
               in_place: bool, inject_oom: Callable[[int], bool] | None) -> BaseException | None:
    """Forward and backward of every micro-batch (the engine's micro-step after each but the last);
    the out-of-memory error that cut them short where the ranks retry in place, else None."""
    for i, mb in enumerate(micro_batches):
        try:
            inputs = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
            loss_sum = engine(inputs.pop("input_ids"), labels=inputs.pop("labels"), reduction="sum", **inputs)
            scaled = loss_sum * scale
            if inject_oom is not None and inject_oom(i):
                scaled.register_hook(raise_out_of_memory)
            engine.backward(scaled, scale_wrt_gas=False)
        except torch.OutOfMemoryError as exc:  # by its type: the allocator's own error
            if not in_place:
                raise
            # without its traceback: its frames would keep this micro-batch's activations alive
            return exc.with_traceback(None)
        loss_sum_local += loss_sum.detach().double()
        if i < len(micro_batches) - 1:
            engine.step()  # a micro-step: DeepSpeed applies nothing before the boundary
    return None


def skip_update(engine: DeepSpeedEngine) -> None:
    """Make the coming optimizer update a no-op: zero gradients and learning rate 0 for it (the
    scheduler sets the next step's rate as usual)."""
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()
    for group in getattr(getattr(engine, "optimizer", None), "param_groups", []):
        group["lr"] = 0.0


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

    def device_values(self) -> tuple:
        """(loss, grad_norm) as the step left them (device tensors until someone reads them)."""
        if "loss" in self._values:
            return self._values["loss"], self._values["grad_norm"]
        return self._loss, self._grad_norm

    def watch(self, flag: torch.Tensor | None) -> None:
        """Read ``flag`` (a device integer, the non-finite guard's first bad step) with the loss, in
        the same copy to the host; after that read: ``first_nonfinite``."""
        if "loss" not in self._values:
            self._first_nonfinite = flag

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
    faults: FaultPoints | None = None,
    beacon: Beacon | None = None,
) -> TrainState:
    """Train from ``state.step`` to ``state.total_steps`` (or until a stop is requested).

    Whatever happens, every callback's ``close`` runs, in call order. An exception from a step
    or a hook is first passed to every ``on_error``, then re-raised; a ``close`` that fails
    meanwhile is logged and does not hide it. After a stage that ended, the first failed
    ``close`` is raised once every other callback is closed. ``faults``: the fault injection's
    out-of-memory errors (``DS_TRHASH_FAULT=oom_at_step:...``). ``beacon``: this rank's liveness
    beacon (training/liveness/), set at each place of a step (attribute writes only)."""
    failed = False
    try:
        return _train(engine, loader, state, callbacks, device, world_size, lr_of, vocab_size, faults,
                      beacon or Beacon())
    except BaseException as exc:
        failed = True
        for cb in callbacks:
            cb.on_error(exc)
        raise
    finally:
        _close_all(callbacks, raise_first=not failed)


def decide_together(callbacks: list[Callback], state: TrainState, check: UpdateCheck) -> int:
    """The step's one decision point: every callback's vote (an out-of-memory error is a RETRY of
    its own), the largest over the ranks in one host all-reduce."""
    vote = max([GO_ON, *(cb.before_update(state, check) for cb in callbacks)])
    failed = 0
    if check.out_of_memory is not None:
        vote, failed = RETRY, (dist.get_rank() if is_multi_rank() else 0) + 1
    vote, failed = host_all_reduce([vote, failed], "max")
    check.failed_rank = failed - 1 if failed else None
    return vote


def agreed_step(engine: DeepSpeedEngine, loader: DataLoader, state: TrainState, callbacks: list[Callback],
                device: torch.device, world_size: int, vocab_size: int | None, faults: FaultPoints | None = None,
                beacon: Beacon | None = None) -> dict:
    """Optimizer step ``state.step + 1`` as every rank decided it: trained again on the same rows at
    the next smaller micro-batch for as long as every rank agrees to retry it (out of memory)."""
    beacon = beacon or Beacon()
    step = state.step + 1
    beacon.at(step, MARK_DATA, DATA_WAIT)
    rows = loader.micro_batches(state.step)  # read once: a retry trains the very same rows
    inject = None if faults is None else (lambda micro_step: faults.out_of_memory_due(step, micro_step))
    while True:
        beacon.at(step, MARK_FORWARD, FIRST_STEP if state.steps_timed == 0 else FORWARD_BACKWARD)
        cut = recut(rows, state.micro_batch)
        try:
            stats = train_step(engine, cut, device, world_size, vocab_size, step=step, inject_oom=inject,
                               decide=lambda check: decide_together(callbacks, state, check), beacon=beacon)
        except torch.OutOfMemoryError as exc:  # a collective lay in between: every rank stops
            raise _out_of_memory_exit(engine, step, cut, rows) from exc
        if stats["decision"] != RETRY:
            return stats
        smaller = smaller_micro_batch(len(cut[0]["input_ids"]), rows_of(rows))
        if smaller is None:
            raise MicroBatchFloor(step)
        state.micro_batch = smaller
        for cb in callbacks:
            cb.on_retry(state, stats["check"], smaller)


def _out_of_memory_exit(engine: DeepSpeedEngine, step: int, cut: MicroBatches, rows: MicroBatches) -> BaseException:
    old = len(cut[0]["input_ids"])
    smaller = smaller_micro_batch(old, rows_of(rows))
    if smaller is None:
        return MicroBatchFloor(step)
    rank = dist.get_rank() if is_multi_rank() else 0
    return OutOfMemoryExit(step, rank, old, smaller, rows_of(rows) // smaller, why_not_in_place(engine))


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
           faults: FaultPoints | None, beacon: Beacon) -> TrainState:
    """The steps and the hooks of a stage (``run`` puts the lifecycle around them)."""
    state.epoch = state.epochs_done = loader.epoch_of(state.step)
    for i, cb in enumerate(callbacks):
        if state.stop_requested:  # agreed before the first step (the stop callback starts first): no
            break  # evaluation of the starting point, no profiler; every on_end still runs
        beacon.at(state.step, HOOKS + i, cb.phase)
        cb.on_start(state)
    state.throughput.start()
    while state.step < state.total_steps and not state.stop_requested:
        epoch = loader.epoch_of(state.step)
        t0 = time.perf_counter()
        lr = lr_of()
        stats = agreed_step(engine, loader, state, callbacks, device, world_size, vocab_size, faults, beacon)
        dt = time.perf_counter() - t0
        state.step += 1
        state.step_seconds += dt
        state.steps_timed += 1
        state.update_skipped = stats["decision"] == SKIP_UPDATE
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
        }, loss=stats["loss"], grad_norm=stats["grad_norm"])
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
