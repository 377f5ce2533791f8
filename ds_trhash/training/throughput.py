"""The launch's steady-state tokens per second: the figure to compare with bench_step.py.

One step's own time (``step_time`` in metrics.csv) is the host's time in ``train_step``; the
device runs behind the host, so a step's work can finish inside a later step or inside a
callback that reads the loss, and one step's tokens/s swings both ways. The steady rate is taken
over wall-clock intervals instead: an interval runs from the end of one step's callbacks to the
end of the next one's, so it holds the step, its data and everything the launch does per step.
Over many steps the queued device work is all inside the intervals, and the rate is the
launch's real throughput. Two kinds of interval are kept out and counted apart:

* the first ``warmup`` steps of this process (compilation, kernel autotuning, the allocator's
  growth), which a benchmark leaves untimed too;
* an interval in which a callback paused training (a checkpoint save, an evaluation): each one
  says so with ``TrainState.pause(reason)``. Their cost is real but periodic, and it is reported
  where it happens (the checkpoint line gives its seconds).
"""
from __future__ import annotations

import time
from typing import Callable

#: Steps of each launch left out of the steady rate (the bench's warm-up on CUDA is 3 steps).
WARMUP_STEPS = 3


class SteadyRate:
    """Tokens per second over the intervals that are neither warm-up nor paused."""

    def __init__(self, warmup: int = WARMUP_STEPS, clock: Callable[[], float] = time.perf_counter):
        self.warmup = warmup
        self.clock = clock
        self._mark = clock()
        self.seen = 0  # intervals noted
        self.tokens, self.seconds = 0, 0.0  # of the steady intervals
        self.steady_steps = 0
        self.first_steady: int | None = None
        self.last_steady: int | None = None
        self.all_tokens, self.all_seconds = 0, 0.0  # every interval, warm-up and pauses included
        self.paused: dict[str, int] = {}  # reason -> intervals left out for it

    def start(self) -> None:
        """The first interval starts now (the loop calls it before its first step)."""
        self._mark = self.clock()

    def note(self, step: int, tokens: int, pauses: list[str]) -> None:
        """Step ``step`` and its callbacks ended now; it trained ``tokens`` (all ranks)."""
        now = self.clock()
        seconds, self._mark = now - self._mark, now
        self.seen += 1
        self.all_tokens += tokens
        self.all_seconds += seconds
        if self.seen <= self.warmup:
            return
        if pauses:
            for reason in set(pauses):
                self.paused[reason] = self.paused.get(reason, 0) + 1
            return
        self.tokens += tokens
        self.seconds += seconds
        self.steady_steps += 1
        self.first_steady = step if self.first_steady is None else self.first_steady
        self.last_steady = step

    @property
    def rate(self) -> float | None:
        """Steady tokens/s, None before the first steady interval."""
        return self.tokens / self.seconds if self.steady_steps and self.seconds > 0 else None

    @property
    def overall(self) -> float | None:
        """Tokens/s over every interval of this launch, warm-up and pauses included."""
        return self.all_tokens / self.all_seconds if self.all_seconds > 0 else None

    def describe(self) -> str | None:
        """The end-of-stage line, or None when no steady interval was measured."""
        if self.rate is None:
            return None
        left_out = [f"{min(self.warmup, self.seen)} warm-up"] + [f"{n} {why}" for why, n in sorted(self.paused.items())]
        return (f"throughput: steady {self.rate:,.0f} tokens/s over {self.steady_steps} steps "
                f"({self.first_steady}-{self.last_steady}; left out: {', '.join(left_out)}); "
                f"{self.overall:,.0f} tokens/s over all {self.seen} steps of this launch")
