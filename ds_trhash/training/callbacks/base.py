"""The callback interface: what the training loop calls, and what a callback is given.

The loop (``ds_trhash.training.loop``) knows nothing but an engine, a batch source and a list of
``Callback`` objects; everything else a launch does per step (progress, metrics, checkpoints,
evaluation, selection, stop handling, fault injection) is a callback. Packages above training
(evaluation) implement this interface; the entry point that composes a launch decides which
callbacks it gets (``ds_trhash.run``), so training never imports them.

A callback is made in two steps, both from the config:

* ``prepare(cfg)`` runs before the model exists and may refuse the launch (a malformed input
  file fails in seconds); it returns a builder, or None when the config does not ask for it;
* the builder gets the ``RunContext`` once the engine exists and returns the callback.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # type names only: the loop imports this module
    from ds_trhash.training.loop import TrainState

Builder = Callable[["RunContext"], Optional["Callback"]]


class Callback:
    """Hooks; each returns nothing and may set ``state.stop_requested``."""

    @classmethod
    def prepare(cls, cfg: Any) -> Builder | None:
        """Before the model: check inputs, return a builder (default: ``from_run``)."""
        return cls.from_run

    @classmethod
    def from_run(cls, run: "RunContext") -> "Callback | None":
        """The callback for this launch, or None when its config leaves it off."""
        raise NotImplementedError(f"{cls.__name__} is built by its own prepare()")

    def on_start(self, state: "TrainState") -> None: ...

    def on_step_end(self, state: "TrainState", metrics: dict) -> None: ...

    def on_epoch_end(self, state: "TrainState") -> None: ...

    def on_end(self, state: "TrainState") -> None: ...


@dataclass
class RunContext:
    """What one launch hands its callbacks once the engine exists.

    ``results`` is where evaluation callbacks leave their numbers, by kind and step
    (``results["eval"][step]``, ``results["piqa"][step]``), for the checkpoint record and the
    selection of ``best/``; ``last_checkpoint`` is the newest checkpoint this launch wrote.
    """

    cfg: Any  # TrainConfig
    rank: int
    world: int
    output_dir: Path
    device: Any  # torch.device
    engine: Any  # the DeepSpeed engine (forward, save_checkpoint)
    model: Any  # the module inside it (backends_used)
    model_config: Any  # TRHashConfig
    batches: Any  # loop.StepBatches
    progress: Any  # training.display.Progress
    writer: Any  # training.records.metrics_csv.MetricsWriter
    trainer_state: Callable[[Any, str, dict], dict]  # (state, reason, extra) -> trainer_state.json
    eval_batches: Any = None  # SFTBatches over the held-out partition, when configured
    tokenizer_dir: str | None = None
    protect_steps: set[int] = field(default_factory=set)  # never rotated away
    stop: Any = None  # callbacks.stop.StopAgreement, asked once per step on every rank
    faults: Any = None  # callbacks.faults.FaultInjection
    barrier: Callable[[], Any] = lambda: None
    monitor: Any = None  # training.records.monitor.MonitorSink: DeepSpeed's monitors (TensorBoard, CSV, W&B)
    expert_load: Any = None  # training.records.expert_load.ExpertLoadWriter: expert_load.csv
    # called with the state on every rank right before each checkpoint is written (collectives allowed)
    before_save: list[Callable[[Any], Any]] = field(default_factory=list)
    results: dict[str, dict[int, dict]] = field(default_factory=lambda: {"eval": {}, "piqa": {}})
    last_checkpoint: Path | None = None


def is_epoch_end(batches: Any, step: int) -> bool:
    """Whether optimizer step ``step`` (> 0) completes an epoch of ``batches`` (loop.StepBatches)."""
    return step > 0 and batches.epoch_of(step) != batches.epoch_of(step - 1)


def build_callbacks(parts: list[type[Callback]], cfg: Any) -> list[Builder]:
    """``prepare`` of every part, in order, before the model: the builders of those the config asks for."""
    return [b for b in (part.prepare(cfg) for part in parts) if b is not None]


def make_callbacks(builders: list[Builder], run: RunContext) -> list[Callback]:
    """The launch's callbacks, in the order of ``builders`` (the loop calls them in this order)."""
    return [cb for cb in (b(run) for b in builders) if cb is not None]
