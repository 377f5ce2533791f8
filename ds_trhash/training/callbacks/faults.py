"""Crashing on purpose, for the crash-safety tests (``DS_TRHASH_FAULT``); unset in normal runs."""
from __future__ import annotations

import os
import signal

from ds_trhash.training.callbacks.base import Callback, RunContext

FAULT_ENV = "DS_TRHASH_FAULT"


class FaultInjection:
    """``DS_TRHASH_FAULT=kill_after_step:N`` SIGKILLs every rank right after optimizer step N
    (before its checkpoint), and ``kill_during_save:N`` SIGKILLs them inside the save of step N,
    after DeepSpeed wrote its files and before the checkpoint is complete."""

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

    def maybe_kill(self, kind: str, step: int) -> None:
        if self.kind == kind and self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)


class FaultCallback(Callback):
    """``kill_after_step``: the kill right after the step, before any other callback saves it."""

    def __init__(self, faults: FaultInjection):
        self.faults = faults

    @classmethod
    def from_run(cls, run: RunContext) -> "FaultCallback":
        return cls(run.faults if run.faults is not None else FaultInjection(None))

    def on_step_end(self, state, metrics):
        self.faults.maybe_kill("kill_after_step", state.step)
