"""``profile.steps: [A, B]``: a torch.profiler trace of optimizer steps A..B, one file per rank.

The profiler is started with the stage but idles (records nothing) until step A-1, in which it
warms up (not in the trace); it records steps A..B with their callbacks, each step marked
``ProfilerStep#n`` (n the optimizer step), hence A >= 2. After step B each rank writes
``<output_dir>/profile/rank<r>.<time>.pt.trace.json`` through ``tensorboard_trace_handler``: a
Chrome trace that TensorBoard's profiler plugin (``tensorboard --logdir <output_dir>/profile``)
and Perfetto (ui.perfetto.dev) open. Steps A-1..B run slower, so they stay out of the steady
tokens/s. The callback owns the profiler: a stage that ends, stops or fails before step B still
stops it in ``close``, which writes what was recorded.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ds_trhash.training.callbacks.base import Builder, Callback, Metrics, RunContext, TrainState

if TYPE_CHECKING:
    from ds_trhash.training.config import TrainConfig

PROFILE_DIR = "profile"


class ProfileCallback(Callback):
    run_files = (PROFILE_DIR,)

    def __init__(self, first: int, last: int, out_dir: Path, rank: int, device: torch.device,
                 message: Callable[[str], None] = print) -> None:
        self.first, self.last = first, last
        self.out_dir, self.rank, self.device, self.message = Path(out_dir), rank, torch.device(device), message
        self.prof: torch.profiler.profile | None = None
        self.written: list[Path] = []
        self.seen: int | None = None  # the last step the profiler ran through

    @classmethod
    def prepare(cls, cfg: TrainConfig) -> Builder | None:
        return cls.from_run if cfg.profile.steps is not None else None

    @classmethod
    def from_run(cls, run: RunContext) -> "ProfileCallback":
        steps = run.cfg.profile.steps
        if steps is None:  # prepare builds this callback only for a profiled window
            raise RuntimeError("profile.steps is not set")
        first, last = steps
        return cls(first, last, run.output_dir / PROFILE_DIR, run.rank, run.device, run.progress.message)

    def _action(self, step: int) -> torch.profiler.ProfilerAction:
        """What the profiler does during optimizer step ``step`` (torch.profiler's schedule)."""
        action = torch.profiler.ProfilerAction
        if step == self.first - 1:
            return action.WARMUP
        if self.first <= step < self.last:
            return action.RECORD
        return action.RECORD_AND_SAVE if step == self.last else action.NONE

    def _written(self, prof: torch.profiler.profile) -> None:
        before = set(self.out_dir.glob(f"rank{self.rank}.*.pt.trace.json"))
        torch.profiler.tensorboard_trace_handler(str(self.out_dir), worker_name=f"rank{self.rank}")(prof)
        self.written = sorted(set(self.out_dir.glob(f"rank{self.rank}.*.pt.trace.json")) - before)
        if self.rank == 0 and self.written:
            self.message(f"profile of steps {self.first}-{self.seen}: {self.written[0]} (one per rank; open "
                         f"with `tensorboard --logdir {self.out_dir}` or ui.perfetto.dev)")

    def on_start(self, state: TrainState) -> None:
        if state.step >= self.last:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, schedule=self._action,
                                           on_trace_ready=self._written)
        self.prof.step_num = state.step + 1  # the step about to run: ProfilerStep#n is optimizer step n
        self.prof.start()

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        if self.prof is None:
            return
        if state.step >= self.first - 1:
            state.pause("profile")  # a profiled step (or the profiler's warm-up) is no steady one
            self.seen = state.step
        if state.step < self.last and state.step < state.total_steps and not state.stop_requested:
            self.prof.step()
        elif state.step >= self.last:
            self.prof.step()  # after step B: the trace is written
            self._stop()
        else:
            self._stop()  # the stage ends (or stops) inside the window: the steps it ran

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            prof.stop()

    def close(self) -> None:
        """A stage that failed inside the window: the trace of what was recorded."""
        if self.prof is not None:
            self._stop()
