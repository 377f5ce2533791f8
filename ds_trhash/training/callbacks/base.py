"""The callback interface: what the training loop calls, and what a callback is given.

The loop (``ds_trhash.training.loop``) knows nothing but an engine, a data loader and a list of
``Callback`` objects; everything else a launch does per step (progress, metrics, checkpoints,
evaluation, selection, stop handling, fault injection) is a callback. Packages above training
(evaluation) implement this interface; the entry point that composes a launch decides which
callbacks it gets (``ds_trhash.run``), so training never imports them.

A callback is made in two steps, both from the config:

* ``prepare(cfg)`` runs before the model exists and may refuse the launch (a malformed input
  file fails in seconds); it returns a builder, or None when the config does not ask for it;
* the builder gets the ``RunContext`` once the engine exists and returns the callback.

The step state the hooks are given (``TrainState``) lives here, with the hooks, and the loop
imports it: a callback module never imports the loop (nor the loop a callback), so the interface
sits below both. The data both read is a ``data.stage.DataLoader``.

Callbacks never read each other's state: what one produces reaches the others as a typed hook
argument, sent to every callback of the launch through ``RunContext`` (``evaluated`` with a
``HeldoutResult`` or ``PiqaResult``, ``checkpoint_saved`` with the checkpoint's step and path,
``before_save``, ``flush``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ds_trhash.engine_api import DeepSpeedEngine
# the phases a callback's hooks may declare (re-exported: evaluation imports nothing of training but this module)
from ds_trhash.training.liveness.phases import CHECKPOINT, EVAL, STEP_END  # noqa: F401
from ds_trhash.training.throughput import SteadyRate

if TYPE_CHECKING:  # type names only: these import much more (and none of them imports this module)
    import torch

    from ds_trhash.data.stage import DataLoader, SFTBatches
    from ds_trhash.model.config import TRHashConfig
    from ds_trhash.model.transformer import TRHashForCausalLM
    from ds_trhash.training.config import TrainConfig
    from ds_trhash.training.display import Progress
    from ds_trhash.training.records.expert_load import ExpertLoadWriter
    from ds_trhash.training.records.metrics_csv import MetricsWriter
    from ds_trhash.training.records.monitor import MonitorSink

Builder = Callable[["RunContext"], Optional["Callback"]]

# one step's metrics as the loop hands them to the callbacks (loss, lr, tokens, ...: numbers, mostly)
Metrics = Mapping[str, Any]


@dataclass(frozen=True)
class HeldoutResult:
    """The held-out loss of the model at ``step`` (``eval/callbacks.py``); ``record()`` is what an
    epoch checkpoint's ``trainer_state.json`` holds under ``eval``."""

    step: int
    epoch: int
    eval_loss: float
    eval_ppl: float
    eval_tokens: int

    def record(self) -> dict:
        return {"eval_loss": self.eval_loss, "eval_ppl": self.eval_ppl, "eval_tokens": self.eval_tokens,
                "step": self.step, "epoch": self.epoch}


@dataclass(frozen=True)
class PiqaResult:
    """Zero-shot PIQA at ``step``; ``record()`` is its ``piqa.jsonl`` row and what an epoch
    checkpoint holds under ``piqa``."""

    step: int
    epoch: int
    acc: float
    acc_norm: float
    n: int
    warning: str | None = None

    def record(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "acc": self.acc, "acc_norm": self.acc_norm, "n": self.n,
                "warning": self.warning}


EvalResult = HeldoutResult | PiqaResult


@dataclass
class StepEvaluation:
    """What the evaluation callbacks measured at one step (either may be missing: off, or not its rank)."""

    heldout: HeldoutResult | None = None
    piqa: PiqaResult | None = None

    def add(self, result: EvalResult) -> None:
        if isinstance(result, HeldoutResult):
            self.heldout = result
        else:
            self.piqa = result


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
    stop_reason: str | None = None  # why the run stopped early (signal, launcher gone), for the exit line
    stop_requeue: bool = False  # stopped on the scheduler's time-limit warning: exit EXIT_REQUEUE
    last: Metrics = field(default_factory=dict)  # metrics of the last step
    step_seconds: float = 0.0  # wall time of the steps this launch trained (not saved)
    steps_timed: int = 0
    # the launch's steady tokens/s (not saved); ``pauses``: why this step's callbacks paused
    # training (a checkpoint, an evaluation), which keeps its interval out of that rate
    throughput: SteadyRate = field(default_factory=SteadyRate)
    pauses: list[str] = field(default_factory=list)
    # the micro-batch in force, when smaller than the data's cut (an out-of-memory step lowered it:
    # training/memory/); None: the cut's. Saved in every checkpoint record; the data cut stays the plan's.
    micro_batch: int | None = None
    update_skipped: bool = False  # the ranks agreed to skip this step's update (training.nonfinite: skip_step)

    def pause(self, reason: str) -> None:
        """A callback paused training in this step (e.g. "checkpoint"): the step's interval is
        left out of the steady tokens/s and counted under ``reason``."""
        self.pauses.append(reason)


# What the callbacks decide together before a step's update, in order of precedence (the
# largest vote of any callback on any rank wins): go on, skip the update (the non-finite guard's
# skip_step), or abandon the step and train it again at a smaller micro-batch (out of memory).
GO_ON, SKIP_UPDATE, RETRY = 0, 1, 2


@dataclass
class UpdateCheck:
    """What one rank knows of a step after its backwards and before its update (``before_update``).

    ``loss`` is this rank's summed loss of the step on the device (reading it is a host read: only
    a callback that must decide from it does); ``grad_norm()`` this rank's own gradient norm where
    the optimizer keeps none (ZeRO 0 fp32), before any reduction; ``out_of_memory`` the error of a
    micro-batch that ran out of device memory on this rank (the loop then votes RETRY itself)."""

    step: int  # the optimizer step being trained, 1-based (state.step once it is done)
    loss: torch.Tensor
    grad_norm: Callable[[], Any]
    out_of_memory: BaseException | None = None
    micro_batch: int = 0  # the micro-batch this attempt ran at
    rows: int = 0  # this rank's rows in the step
    failed_rank: int | None = None  # after the agreement: a rank that ran out of memory (the highest)


class StopQuestion(Protocol):
    """What the stop callback asks once per step (``callbacks.stop.StopAgreement``; named by
    its shape so that this module does not import the callbacks that import it)."""

    @property
    def requeue(self) -> bool: ...

    def __call__(self, next_step: int | None = None) -> bool: ...

    def wait_for_data(self, step: int) -> bool: ...

    def describe(self) -> str: ...


class FaultPoints(Protocol):
    """Where a deliberate crash may happen (``callbacks.faults.FaultInjection``, by its shape)."""

    def due(self, kind: str, step: int) -> bool: ...

    def maybe_kill(self, kind: str, step: int) -> None: ...

    def maybe_hang(self, step: int, rank: int) -> None: ...

    def out_of_memory_due(self, step: int, micro_step: int) -> bool: ...


class Callback:
    """Hooks; each returns nothing and may set ``state.stop_requested``.

    The loop calls ``on_start``, then ``on_step_end`` / ``on_epoch_end`` per step, ``on_end`` when
    the stage ends or stops; ``on_error(exc)`` when any hook or step raised, on every callback;
    and ``close()`` on every callback in any case, last. A callback that owns a resource (an open
    file, a display, a worker thread) releases it in ``close``, so an exception never leaves one
    behind. ``before_save`` is called on every rank right before each checkpoint is written
    (collectives allowed), so that what a checkpoint's step covers is on disk with it;
    ``on_checkpoint_saved(step, path)`` once a checkpoint is complete (every file written and
    hashed, published under its final name), on every rank, possibly during a later step.
    ``on_evaluated(state, result)`` gets each evaluation result (held-out loss, PIQA) on the
    ranks that have it, right after it was measured. ``flush()`` finishes what a callback has in
    flight (a checkpoint written in the background) without ending it.

    ``run_files`` names what the part writes at the top of the output directory: a fresh start
    over a damaged run (``--allow-fresh-over-damaged``) sets every earlier one aside first, so
    nothing of the earlier run is written over.
    """

    run_files: tuple[str, ...] = ()
    # what the liveness heartbeat says this rank does in the hook (training/liveness/phases.py): a
    # callback whose hooks may legitimately take long names its phase (checkpoint, eval), whose limit applies
    phase: str = STEP_END

    @classmethod
    def prepare(cls, cfg: TrainConfig) -> Builder | None:
        """Before the model: check inputs, return a builder (default: ``from_run``)."""
        return cls.from_run

    @classmethod
    def from_run(cls, run: RunContext) -> Callback | None:
        """The callback for this launch, or None when its config leaves it off."""
        raise NotImplementedError(f"{cls.__name__} is built by its own prepare()")

    def on_start(self, state: TrainState) -> None: ...

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None: ...

    def on_epoch_end(self, state: TrainState) -> None: ...

    def before_save(self, state: TrainState) -> None: ...

    def before_update(self, state: TrainState, check: UpdateCheck) -> int:
        """Every rank, once per step after its backwards and before the update (before the
        boundary's gradient reduction where the ranks can retry in place): this callback's vote,
        ``GO_ON``, ``SKIP_UPDATE`` or ``RETRY``. The loop takes the largest over callbacks and ranks
        in one host all-reduce; no collective here."""
        return GO_ON

    def on_retry(self, state: TrainState, check: UpdateCheck, micro_batch: int) -> None:
        """Every rank agreed to abandon the step (nothing applied) and train it again at
        ``micro_batch`` (``state.micro_batch``); ``check`` is the failed attempt."""

    def on_checkpoint_saved(self, step: int, path: Path) -> None: ...

    def on_evaluated(self, state: TrainState, result: EvalResult) -> None: ...

    def flush(self) -> None: ...

    def on_end(self, state: TrainState) -> None: ...

    def on_error(self, exc: BaseException) -> None:
        """The stage failed with ``exc`` (re-raised after every callback was told); must not raise."""

    def close(self) -> None:
        """Release what this callback owns; called once, after ``on_end`` or ``on_error``."""


@dataclass
class RunContext:
    """What one launch hands its callbacks once the engine exists.

    ``callbacks`` is the launch's callbacks in call order (``make_callbacks`` fills it in); the
    methods below send one callback's news to all of them, as typed hook arguments.
    """

    cfg: TrainConfig
    rank: int
    world: int
    output_dir: Path
    device: torch.device
    engine: DeepSpeedEngine  # forward, save_checkpoint
    model: TRHashForCausalLM  # the module inside it (backends_used)
    model_config: TRHashConfig
    loader: DataLoader  # the stage's data (epochs, the stream's figures)
    progress: Progress
    writer: MetricsWriter  # metrics.csv
    trainer_state: Callable[[TrainState, str, dict], dict]  # (state, reason, extra) -> trainer_state.json
    eval_batches: SFTBatches | None = None  # over the held-out partition, when configured
    tokenizer_dir: str | None = None
    protect_steps: set[int] = field(default_factory=set)  # never rotated away
    stop: StopQuestion | None = None  # asked once per step on every rank
    faults: FaultPoints | None = None
    barrier: Callable[[], Any] = lambda: None
    monitor: MonitorSink | None = None  # DeepSpeed's monitors (TensorBoard, CSV, W&B)
    expert_load: ExpertLoadWriter | None = None  # expert_load.csv
    callbacks: list[Callback] = field(default_factory=list)

    def before_save(self, state: TrainState) -> None:
        for cb in self.callbacks:
            cb.before_save(state)

    def checkpoint_saved(self, step: int, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_checkpoint_saved(step, path)

    def evaluated(self, state: TrainState, result: EvalResult) -> None:
        for cb in self.callbacks:
            cb.on_evaluated(state, result)

    def flush(self) -> None:
        for cb in self.callbacks:
            cb.flush()


def is_epoch_end(loader: DataLoader, step: int) -> bool:
    """Whether optimizer step ``step`` (> 0) completes an epoch of ``loader``."""
    return step > 0 and loader.epoch_of(step) != loader.epoch_of(step - 1)


def build_callbacks(parts: list[type[Callback]], cfg: TrainConfig) -> list[Builder]:
    """``prepare`` of every part, in order, before the model: the builders of those the config asks for."""
    return [b for b in (part.prepare(cfg) for part in parts) if b is not None]


def make_callbacks(builders: list[Builder], run: RunContext) -> list[Callback]:
    """The launch's callbacks, in the order of ``builders`` (the loop calls them in this order);
    also ``run.callbacks``, for the hooks one callback calls on all (``before_save``)."""
    run.callbacks[:] = [cb for cb in (b(run) for b in builders) if cb is not None]
    return list(run.callbacks)
