"""Stop handling: a stop every rank agrees on, at one step, with one checkpoint, exit 0.

How the DeepSpeed 0.19 launcher delivers a stop decides the design:

- Ctrl-C in a terminal sends SIGINT to the whole process group: the ``deepspeed`` runner,
  ``launch.py`` and every rank. ``launch.py`` then also sends SIGTERM to each rank's process
  tree, so a rank sees the same request twice within milliseconds.
- ``kill -TERM`` of ``launch.py`` reaches the ranks one at a time: it terminates rank 0's tree,
  waits up to 30 s for it to exit, and only then terminates rank 1 (then SIGKILLs what is left).
  Rank 1 therefore learns of the stop only from rank 0.
- SIGTERM to the ``deepspeed`` runner kills the runner alone (it installs no handler on one
  node), leaving ``launch.py`` and the ranks running as orphans.
- A signal to one rank reaches that rank only.
- A terminal that closes sends SIGHUP to its foreground process group: the runner and
  ``launch.py`` (no handler for it) die at once, the ranks record it like SIGTERM (and see
  ``launch.py`` gone), write their stop checkpoint and exit 0.

So a signal handler here only records the request (it never raises and does no I/O), and once
per optimizer step every rank contributes its local request to a MAX all-reduce over a CPU
(gloo) group (0: go on, 1: stop, 2: stop and ask to be requeued, for SIGUSR1, the scheduler's
time-limit warning, which may reach one rank only; beside it whether its data for the next step
is read: ``StopAgreement``). All ranks see the same answer at the same step, write one
checkpoint together and exit 0 (75 after a requeue request). A rank started by ``launch.py``
under the ``deepspeed`` runner also checks, once per step, that both are still alive (one /proc read), and treats their disappearance as a
stop request: nothing is left training as an orphan. The stop lands at the next step boundary,
well inside the launcher's 30 s grace period for any step that takes seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ds_trhash.training.callbacks.base import Callback, Metrics, RunContext, StopQuestion, TrainState
from ds_trhash.training.liveness.phases import DATA_WAIT
# the recorder lives in a module that imports no torch: launch/train.py installs it first of all
from ds_trhash.training.signals import (  # noqa: F401  (re-exported: callers import them from here)
    DUPLICATE_WINDOW_S, EXIT_REQUEUE, STOP_SIGNALS, StopRequests)

if TYPE_CHECKING:  # a type name only
    from ds_trhash.data.stage import DataLoader

# launch.py waits this long for each rank's process tree before it SIGKILLs it.
LAUNCHER_GRACE_S = 30.0
POLL_S = 0.2  # how often the ranks ask each other again while one still reads the next step's data


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    if fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class LauncherWatch:
    """Notices that the DeepSpeed launcher above this rank is gone.

    Active only when this process was started by ``deepspeed.launcher.launch``; the runner above
    it is watched only when it is the ``deepspeed`` command. A process started any other way
    (plain ``python``, a test) watches nothing. Each watched process is identified by pid and
    start time, so a reused pid is not mistaken for it."""

    watched: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def for_this_process(cls) -> "LauncherWatch":
        watch = cls()
        parent = os.getppid()
        if "deepspeed.launcher.launch" not in _cmdline(parent):
            return watch
        stat = _proc_stat(parent)
        if stat is None:
            return watch
        watch.watched.append(("the DeepSpeed launch.py", parent, stat[1]))
        runner = stat[0]
        runner_stat = _proc_stat(runner)
        command = _cmdline(runner)
        if runner_stat is not None and "deepspeed" in command and "deepspeed.launcher.launch" not in command:
            watch.watched.append(("the deepspeed runner", runner, runner_stat[1]))
        return watch

    def gone(self) -> str | None:
        """The first watched process that no longer runs, or None."""
        for name, pid, started in self.watched:
            stat = _proc_stat(pid)
            if stat is None or stat[1] != started:
                return f"{name} (pid {pid}) is gone"
        return None


class StopAgreement:
    """Once per step: does any rank want to stop (and be requeued), and is every rank's data
    for the next step read? The same answers on every rank.

    A MAX all-reduce of four integers over a CPU group (the default group when it is gloo, else
    a gloo group made once here: every rank constructs this object at the same point): a stop
    request (2: and a requeue), whether the rank still reads its part of the next step's row exchange, the status
    of a failed read and its node (``data``: the stage's loader, ``readiness`` / ``agreed``; one
    with nothing read on the training thread is always ready). While a rank still reads, it
    waits for its read at most ``POLL_S`` (``wait_read``: less when the read ends sooner), then
    every rank asks again; the others wait in the all-reduce meanwhile. So no rank waits for a
    read inside a collective for longer than that (whose timeout would end the run instead of the
    read's own budget), a data-bound step starts as soon as the last rank's read is done, a stop
    requested meanwhile is agreed as at any step, and a failed read is known to every rank
    before the step, which each then raises."""

    def __init__(self, requests: StopRequests, watch: LauncherWatch | None = None, world_size: int = 1, *,
                 data: DataLoader) -> None:
        self.requests, self.watch, self.world_size, self.data = requests, watch or LauncherWatch(), world_size, data
        self.local_reason: str | None = None
        self.agreed = False
        self.requeue = False  # agreed too: some rank had the scheduler's warning (SIGUSR1)
        self._group = None
        if world_size > 1:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def _local(self) -> bool:
        if self.local_reason is None:
            if self.requests.requested:
                self.local_reason = self.requests.describe()
            else:
                gone = self.watch.gone()
                if gone:
                    self.local_reason = gone
        return self.local_reason is not None

    def __call__(self, next_step: int | None = None) -> bool:
        """Call on every rank after every optimizer step, naming the step to come (a collective
        when world_size > 1, repeated while a rank still reads that step's data)."""
        if self.agreed:
            return True
        if self.world_size == 1:
            self.agreed = self._local()
            self.requeue = self.agreed and self.requests.requeue
            return self.agreed
        self.agreed = self._agree(next_step, stop=True)
        return self.agreed

    def wait_for_data(self, step: int) -> bool:
        """Before the stage's first step: every rank's data for it read (or a failure known to
        all), or a stop agreed (True): one requested before the first step (while the model was
        built, while its first shards download or stall) is obeyed before it, nothing trained."""
        if self.world_size == 1:
            while not self._local() and self.data.readiness(step)[0]:
                self.data.wait_read(step, POLL_S)
            return self(step)
        self.agreed = self._agree(step, stop=True)
        return self.agreed

    def _agree(self, step: int | None, stop: bool) -> bool:
        while True:
            ready = self.data.readiness(step) if step is not None else (0, 0, 0)
            wants = (2 if self.requests.requeue else 1) if stop and self._local() else 0
            flag = torch.tensor([wants, *ready], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            found = [int(v) for v in flag]
            if found[0]:
                self.requeue = found[0] == 2
                return True
            if not found[1]:
                if step is not None:
                    self.data.agreed(step, found[2], found[3])
                return False
            if ready[0] and step is not None:  # this rank reads: until its read is done, at most POLL_S, then ask again
                self.data.wait_read(step, POLL_S)
            # a rank whose data is read asks again at once: the all-reduce waits for the others

    def describe(self) -> str:
        if self.local_reason is not None:
            return f"stop requested here: {self.local_reason}"
        return "stop requested by another rank" + (" (time-limit warning: requeue)" if self.requeue else "")


class StopCallback(Callback):
    """First in the list: after each optimizer step every rank asks the ``StopAgreement`` (a
    collective), and an agreed stop becomes ``state.stop_requested`` (and ``state.stop_requeue``), which the metrics and
    checkpointing callbacks after it answer (a final metrics row, a "stop signal" checkpoint)
    and the loop obeys."""

    phase = DATA_WAIT

    def __init__(self, stop: StopQuestion) -> None:
        self.stop = stop

    @classmethod
    def from_run(cls, run: RunContext) -> "StopCallback | None":
        return cls(run.stop) if run.stop is not None else None

    def on_start(self, state: TrainState) -> None:
        if self.stop.wait_for_data(state.step):  # before the first step: the loop trains none
            self._stop(state)

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        if self.stop(state.step):
            self._stop(state)

    def _stop(self, state: TrainState) -> None:
        state.stop_requested = True
        state.stop_requeue = self.stop.requeue
        state.stop_reason = self.stop.describe()
