"""The stop-signal recorder: handlers that only record SIGTERM / SIGINT / SIGHUP / SIGUSR1.

It imports nothing but the standard library, so ``launch/train.py`` installs it before it
imports torch and DeepSpeed (seconds). Until then a signal would take the default action and
kill the rank silently: ``launch.py`` sends SIGTERM to every rank as soon as one rank exits with
an error, and a rank 0 still importing would die before printing its refusal (the console then
showed only DeepSpeed's "exits with return code = 2"). Installed first, the request is only
recorded; rank 0 goes on to its own refusal, prints it, and exits. ``callbacks/stop.py`` turns
the recorded requests into a stop every rank agrees on.

``launch/train.py`` is the one place that installs a recorder: it hands it to the entry point
(``run.main`` -> ``entrypoint.main`` -> ``trainer.run_stage``). A caller that runs a launch
inside its own process (the tests) passes none and keeps its own handlers.

SIGUSR1 is a scheduler's warning that the job's time is running out (a SLURM job written by
``ds-trhash ops slurm`` asks for it before its time limit): the same stop with a checkpoint, after
which every rank exits ``EXIT_REQUEUE`` instead of 0, so the job script knows to requeue the job
(it continues with ``--resume auto``). Any other stop signal still exits 0.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

# SIGHUP: a terminal that closes stops the run with a checkpoint, as SIGTERM does, instead of killing it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# The scheduler's early warning before a time limit: stop with a checkpoint, then ask to be requeued.
REQUEUE_SIGNALS = (signal.SIGUSR1,)
# A launch's exit status after such a stop: "stopped with a complete checkpoint, requeue me"
# (sysexits' EX_TEMPFAIL: a temporary failure, try again). 0: finished or stopped on any other
# signal; 1: failed; 2: refused (a user error).
EXIT_REQUEUE = 75
# A rank was lost: another rank stopped answering (killed, frozen, cut off, stuck in one phase
# past its limit), and every rank that could still run ended without waiting on a collective.
# The last complete checkpoint is kept; the same command with --resume auto continues once the
# node is back (the SLURM job requeues without the blamed host).
EXIT_PEER_LOST = 76
# A step ran out of device memory where the ranks could not retry it in place (a collective lay
# between the failure and their agreement): every rank ended; --resume auto continues from the
# last complete checkpoint at the smaller micro-batch the run recorded.
EXIT_OUT_OF_MEMORY = 77
# A file of signal names (one a line) that reached the job before this process could record them: a
# SLURM job written by `ds-trhash ops slurm` writes there every warning or stop it passes on, so a
# rank that was still starting (its SIGUSR1 ignored, inherited from the launcher) takes it when it
# installs its recorder (``StopRequests.adopt_pending``).
PENDING_SIGNALS_ENV = "DS_TRHASH_PENDING_SIGNALS"
# Deliveries of the same signal closer together than this are one request (launcher + terminal).
DUPLICATE_WINDOW_S = 2.0


@dataclass
class StopRequests:
    """Signal handlers that only record: which signals came, when, and how many distinct requests.

    Installed once per process, at the start of the launch, and left installed until the process
    exits, so a late duplicate (``launch.py`` terminating a rank that is already finishing) never
    falls back to the default action and kills a rank mid-exit.
    """

    signals: tuple[int, ...] = STOP_SIGNALS
    window_s: float = DUPLICATE_WINDOW_S
    deliveries: list[tuple[int, float]] = field(default_factory=list)
    requests: int = 0
    _last: dict[int, float] = field(default_factory=dict)
    _previous: dict[int, Any] = field(default_factory=dict)

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        now = time.monotonic()
        self.deliveries.append((signum, now))
        last = self._last.get(signum)
        self._last[signum] = now
        if last is None or now - last > self.window_s:
            self.requests += 1

    @property
    def requested(self) -> bool:
        return bool(self.deliveries)

    @property
    def requeue(self) -> bool:
        """Whether a delivered signal asks for a requeue (the scheduler's time-limit warning)."""
        return any(signum in REQUEUE_SIGNALS for signum, _ in self.deliveries)

    @property
    def first_at(self) -> float | None:
        return self.deliveries[0][1] if self.deliveries else None

    def describe(self) -> str:
        """What was received, for the log line written at the step boundary."""
        if not self.deliveries:
            return "no signal"
        names = []
        for signum in dict.fromkeys(s for s, _ in self.deliveries):
            count = sum(1 for s, _ in self.deliveries if s == signum)
            names.append(signal.Signals(signum).name + (f" x{count}" if count > 1 else ""))
        extra = len(self.deliveries) - self.requests
        return ", ".join(names) + (f" ({extra} duplicate deliveries counted once)" if extra else "")

    def install(self) -> "StopRequests":
        for sig in self.signals:
            self._previous.setdefault(sig, signal.signal(sig, self.handle))
        return self

    def adopt_pending(self, environ: dict[str, str] | None = None) -> "StopRequests":
        """Record the signals ``$DS_TRHASH_PENDING_SIGNALS`` names, as if delivered now.

        Called right after ``install``: a signal sent before then was either ignored or is in the
        file, and one sent after reaches the handler; each is then one request (a signal both
        adopted here and delivered falls in the duplicate window). Names outside ``signals`` and
        an unreadable file are passed over: the file is the job script's, not the user's.
        """
        path = (os.environ if environ is None else environ).get(PENDING_SIGNALS_ENV)
        try:
            lines = open(path).read().split() if path else []
        except OSError:
            lines = []
        known = {signal.Signals(sig).name.removeprefix("SIG"): sig for sig in self.signals}
        for name in dict.fromkeys(lines):
            if name in known:
                self.handle(known[name])
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
