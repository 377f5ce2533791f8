"""Stop handling: a signal asks the run to stop after the current step, with a checkpoint.

``GracefulStop`` owns the signal handlers (a small self-contained class: the stop decision
across ranks is built on top of it); ``StopCallback`` turns its flag into
``state.stop_requested`` after each optimizer step, which the checkpointing callback answers
with a "stop signal" checkpoint and the loop with a clean exit.
"""
from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from typing import Any

from ds_trhash.checkpoints import CheckpointError
from ds_trhash.training.callbacks.base import Callback, RunContext

Log = Callable[[str], None]


class GracefulStop:
    """SIGTERM/SIGINT set ``should_stop`` instead of killing the process mid-step.

    The loop polls the flag after each optimizer step, writes a checkpoint and exits cleanly.
    A second signal raises KeyboardInterrupt: the operator insists, so stop now, without a
    checkpoint (the previous complete one remains). Previous handlers come back on exit.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), log: Log = print) -> None:
        self.signals = tuple(signals)
        self.log = log
        self.should_stop = False
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.should_stop:
            raise KeyboardInterrupt(f"second {name}: stopping now without a checkpoint")
        self.should_stop = True
        self.received = name
        self.log(f"{name} received: finishing the current step, writing a checkpoint, then exiting "
                 "(send it again to stop at once)")

    def __enter__(self) -> "GracefulStop":
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as exc:
            self.__exit__(None, None, None)
            raise CheckpointError(f"GracefulStop must be entered in the main thread: {exc}") from exc
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()



class StopCallback(Callback):
    """First in the list: after each optimizer step, a received signal becomes
    ``state.stop_requested``, which the metrics and checkpointing callbacks after it answer (a
    final metrics row, a "stop signal" checkpoint) and the loop obeys."""

    def __init__(self, stop: GracefulStop):
        self.stop = stop

    @classmethod
    def from_run(cls, run: RunContext) -> "StopCallback | None":
        return cls(run.stop) if run.stop is not None else None

    def on_step_end(self, state, metrics):
        if self.stop.should_stop:
            state.stop_requested = True
