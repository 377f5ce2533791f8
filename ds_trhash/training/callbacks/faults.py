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
    is complete. ``oom_at_step:N:R[:M]``: rank R raises ``torch.OutOfMemoryError`` once, inside the
    backward of its micro-batch M (default 0, the first) of optimizer step N."""

    def __init__(self, spec: str | None, rank: int | None = None):
        self.kind, self.step = None, -1
        self.oom_at: tuple[int, int, int] | None = None  # (step, rank, micro-step); one of each kind, comma-separated
        for part in (spec.split(",") if spec else []):
            kind, _, rest = part.partition(":")
            numbers = rest.split(":")
            if kind == "oom_at_step" and 2 <= len(numbers) <= 3 and all(n.isdigit() for n in numbers):
                self.oom_at = (int(numbers[0]), int(numbers[1]), int(numbers[2]) if len(numbers) == 3 else 0)
            elif kind in ("kill_after_step", "kill_during_save") and rest.isdigit():
                self.kind, self.step = kind, int(rest)
            else:
                raise ValueError(f"DS_TRHASH_FAULT={spec!r}: expected kill_after_step:N, kill_during_save:N or "
                                 "oom_at_step:N:R[:M] (a kill and an oom_at_step may be given together, comma-separated)")
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank

    @classmethod
    def from_env(cls) -> "FaultInjection":
        return cls(os.environ.get(FAULT_ENV))

    def due(self, kind: str, step: int) -> bool:
        return self.kind == kind and self.step == step

    def out_of_memory_due(self, step: int, micro_step: int) -> bool:
        """oom_at_step: true once, on its rank, at its step and micro-step."""
        if self.oom_at != (step, self.rank, micro_step):
            return False
        self.oom_at = None  # once
        return True

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
