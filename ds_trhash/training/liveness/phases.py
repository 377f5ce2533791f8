"""What a rank is doing, as its heartbeat says it: the phase names, their time limits, and the
``Beacon`` the training thread writes them into.

The training thread only assigns attributes of the beacon (``step``, ``mark``, ``phase``): no
lock, no call, no I/O. The liveness thread reads them once per interval; a torn read (a new
``step`` with the previous ``mark``) lasts one interval and is never judged on its own, since a
verdict needs a position held for minutes.

A rank's *position* is ``(step, mark)``: ``step`` is the optimizer step it is in (or has just
finished, in that step's hooks), ``mark`` counts the places of one step in the order every rank
passes them (the data, forward/backward, the optimizer, each callback hook in call order). Every
rank passes the same places in the same order, so the rank with the lowest position is the one
the others wait for. ``phase`` names what the place is, and so which time limit applies.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

STARTUP = "startup"  # from the process group's start to the first step: plan, model, engine, checkpoint load/reshard
DATA_WAIT = "data_wait"  # waiting for the next step's data (the stop agreement's poll, the stream's assembly)
FIRST_STEP = "first_step"  # a launch's first step: compilation, Triton autotuning, the experts probe
FORWARD_BACKWARD = "forward_backward"
OPTIMIZER = "optimizer"
STEP_END = "step_end"  # the hooks after a step (metrics, progress, fault injection, ...)
CHECKPOINT = "checkpoint"  # a checkpoint captured, written, waited for, rotated; best/ selected
EVAL = "eval"  # held-out loss, PIQA
PROBE = "probe"  # a probe or recompile inside a step (e.g. a micro-batch probe): its own limit
END = "end"  # after the last step: the final checkpoint, final/ export, the closing barrier

PHASES = (STARTUP, DATA_WAIT, FIRST_STEP, FORWARD_BACKWARD, OPTIMIZER, STEP_END, CHECKPOINT, EVAL, PROBE, END)

# the marks of one step: the data, forward/backward, optimizer; each hook after them counts from HOOKS
MARK_DATA, MARK_FORWARD, MARK_OPTIMIZER, HOOKS = 0, 1, 2, 3
# start-up before any step, and the end after the last: below and above every step's marks
MARK_STARTUP, MARK_END = -1, 1_000_000


@dataclass
class Beacon:
    """Where this rank is: written by the training thread, read by the liveness thread."""

    step: int = 0
    mark: int = MARK_STARTUP
    phase: str = STARTUP

    def at(self, step: int, mark: int, phase: str) -> None:
        """Set the position and phase together (three attribute writes)."""
        self.step, self.mark, self.phase = step, mark, phase

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """``phase`` for the body (e.g. ``PROBE`` around a probe), the previous phase after it."""
        before = self.phase
        self.phase = phase
        try:
            yield
        finally:
            self.phase = before


@dataclass(frozen=True)
class Limits:
    """Seconds: how long a rank may go unheard (``silent_s``), how long it may hold one position
    while another rank is ahead of it, by phase (``by_phase``; ``stuck_s`` for the others), and
    the heartbeat ``interval_s``."""

    interval_s: float
    silent_s: float
    stuck_s: float
    by_phase: dict[str, float]

    def of(self, phase: str) -> float:
        return self.by_phase.get(phase, self.stuck_s)
