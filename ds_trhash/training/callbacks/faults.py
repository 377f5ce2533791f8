"""Crashing on purpose, for the crash-safety tests (``DS_TRHASH_FAULT``); unset in normal runs."""
from __future__ import annotations

import os
import signal

from ds_trhash.training.callbacks.base import Callback, FaultPoints, Metrics, RunContext, TrainState

FAULT_ENV = "DS_TRHASH_FAULT"


class FaultInjection:
    """``DS_TRHASH_FAULT=kill_after_step:N`` SIGKILLs every rank right after optimizer step N
    (before its checkpoint, once the checkpoints of earlier steps are complete, so a test knows
    which one a resume picks), and ``kill_during_save:N`` SIGKILLs them inside the background
    write of step N's checkpoint, after the rank's files are on disk and before the checkpoint
    is complete."""

    def __init__(self, spec: str | None):
        self.kind, self.step = None, -1
        if spec:
            kind, _, step = spec.partition(":")
            if kind not in ("kill_after_step", "kill_during_save") or not step.isdigit():
                raise ValueError(f"DS_TRHASH_FAULT={spec!r}: expected kill_after_step:N or kill_during_save:N")
            self.kind, self.step = kind, int(step)

    @classmethod
    def from_env(cls) -> "FaultInjection":
        return cls(os.environ.get(FAULT_ENV))

    def due(self, kind: str, step: int) -> bool:
        return self.kind == kind and self.step == step

    def maybe_kill(self, kind: str, step: int) -> None:
        if self.due(kind, step):
            os.kill(os.getpid(), signal.SIGKILL)


class FaultCallback(Callback):
    """``kill_after_step``: the kill right after the step, before any other callback saves it."""

    def __init__(self, faults: FaultPoints, run: RunContext | None = None) -> None:
        self.faults, self.run = faults, run

    @classmethod
    def from_run(cls, run: RunContext) -> "FaultCallback":
        return cls(run.faults if run.faults is not None else FaultInjection(None), run)

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        if self.faults.due("kill_after_step", state.step) and self.run is not None:
            self.run.flush()  # earlier steps' checkpoints complete: the crash comes after them
        self.faults.maybe_kill("kill_after_step", state.step)
