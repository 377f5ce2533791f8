"""Crashing on purpose, for the crash-safety and liveness tests (``DS_TRHASH_FAULT``); unset in normal runs."""
from __future__ import annotations

import os
import signal
import threading

from ds_trhash.training.callbacks.base import Callback, FaultPoints, Metrics, RunContext, TrainState

FAULT_ENV = "DS_TRHASH_FAULT"
KINDS = ("kill_after_step", "kill_during_save", "hang_after_step")
EXPECTED = ("expected kill_after_step:N, kill_during_save:N or hang_after_step:N:RANK, and/or oom_at_step:N:R[:M] "
            "(comma-separated)")


class FaultInjection:
    """``DS_TRHASH_FAULT=kill_after_step:N`` SIGKILLs every rank right after optimizer step N
    (before its checkpoint, once the checkpoints of earlier steps are complete, so a test knows
    which one a resume picks), ``kill_during_save:N`` SIGKILLs them inside the background write
    of step N's checkpoint, after the rank's files are on disk and before the checkpoint is
    complete, and ``hang_after_step:N:R`` blocks rank R's training thread forever right after
    step N, its process otherwise alive (its liveness heartbeat goes on): a rank stuck while alive.
    ``oom_at_step:N:R[:M]``: rank R raises ``torch.OutOfMemoryError`` once, inside the backward of
    its micro-batch M (default 0, the first) of optimizer step N; it may join one of the others
    (comma-separated)."""

    def __init__(self, spec: str | None, rank: int | None = None):
        self.kind, self.step, self.rank = None, -1, None  # rank: the one that hangs
        self.oom_at: tuple[int, int, int] | None = None  # (step, rank, micro-step)
        for part in (spec.split(",") if spec else []):
            kind, _, rest = part.partition(":")
            numbers = rest.split(":")
            if kind == "oom_at_step" and 2 <= len(numbers) <= 3 and all(n.isdigit() for n in numbers):
                self.oom_at = (int(numbers[0]), int(numbers[1]), int(numbers[2]) if len(numbers) == 3 else 0)
                continue
            step, _, hang_rank = rest.partition(":")
            hangs = kind == "hang_after_step"
            if kind not in KINDS or not step.isdigit() or (hangs != hang_rank.isdigit()) or (hang_rank and not hangs):
                raise ValueError(f"DS_TRHASH_FAULT={spec!r}: {EXPECTED}")
            self.kind, self.step, self.rank = kind, int(step), int(hang_rank) if hangs else None
        self.own_rank = int(os.environ.get("RANK", "0")) if rank is None else rank  # this process's

    @classmethod
    def from_env(cls) -> "FaultInjection":
        return cls(os.environ.get(FAULT_ENV))

    def due(self, kind: str, step: int, rank: int | None = None) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)

    def out_of_memory_due(self, step: int, micro_step: int) -> bool:
        """oom_at_step: true once, on its rank, at its step and micro-step."""
        if self.oom_at != (step, self.own_rank, micro_step):
            return False
        self.oom_at = None  # once
        return True

    def maybe_kill(self, kind: str, step: int) -> None:
        if self.due(kind, step):
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_hang(self, step: int, rank: int, forever: threading.Event | None = None) -> None:
        """``hang_after_step``: block this (training) thread on an event nobody sets."""
        if self.due("hang_after_step", step, rank):
            (forever or threading.Event()).wait()


class FaultCallback(Callback):
    """``kill_after_step``: the kill right after the step, before any other callback saves it;
    ``hang_after_step``: the hang, at the same place."""

    def __init__(self, faults: FaultPoints, run: RunContext | None = None) -> None:
        self.faults, self.run = faults, run

    @classmethod
    def from_run(cls, run: RunContext) -> "FaultCallback":
        return cls(run.faults if run.faults is not None else FaultInjection(None), run)

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        if self.faults.due("kill_after_step", state.step) and self.run is not None:
            self.run.flush()  # earlier steps' checkpoints complete: the crash comes after them
        self.faults.maybe_kill("kill_after_step", state.step)
        if self.run is not None:
            self.faults.maybe_hang(state.step, self.run.rank)
