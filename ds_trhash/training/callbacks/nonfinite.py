"""A diverged run stops instead of saving NaN: the non-finite guard of the training loop.

Every step's loss (already summed over the ranks) and gradient norm (already global) are tested
for finiteness on the device; the first step that failed is kept in a device tensor, so a step
copies nothing to the host for it. The host reads that tensor only where the loop reads the
device anyway: together with the loss at the loop's check steps (the logging steps) and before
every checkpoint (a save synchronises regardless). The ranks then agree on the earliest bad step
(a host all-reduce, like the stop signal's), and every rank raises ``NonFiniteError`` at the same
step: the run ends non-zero naming that step, and no checkpoint of the diverged weights is ever
written, so ``--resume auto`` continues from the last finite one.

``training.nonfinite: skip_step`` instead tests each step before the optimizer applies it, at the
loop's one decision point (``before_update``; one host read per step, the price of deciding in
time): each rank votes from its own loss and gradient norm (non-finite on one rank is non-finite
in the sum), the ranks agree with the loop's other votes, and a non-finite step is skipped (its gradients
zeroed and its learning rate set to 0 for that one update, so the weights do not move; the data
and the schedule go on), counted and reported; ``training.nonfinite_max_skips`` skipped in a
row end the run as above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol, cast

import torch

from ds_trhash.errors import UserError
from ds_trhash.ranks import host_all_reduce
from ds_trhash.training.callbacks.base import GO_ON, SKIP_UPDATE, Callback, RunContext, TrainState, UpdateCheck
from ds_trhash.training.config import TrainConfig

NONE = -1  # no non-finite step seen (on the device)
UNSEEN = 2**62  # the same, as agreed over the ranks (the smallest bad step wins)
MODES = ("stop", "skip_step")


class _StepValues(Protocol):
    """What the guard reads of a step's metrics (``loop.StepMetrics``)."""

    first_nonfinite: int | None

    def device_values(self) -> tuple[torch.Tensor, torch.Tensor | float | None]: ...

    def watch(self, flag: torch.Tensor | None) -> None: ...

    def __getitem__(self, key: str) -> object: ...


class NonFiniteError(UserError, RuntimeError):
    """Training diverged: a failed run (exit 1), reported as one line naming the step."""

    exit_code = 1


def is_finite(loss: torch.Tensor, grad_norm: torch.Tensor | float | None) -> bool:
    """A host decision (reads the device): both values finite."""
    ok = bool(torch.isfinite(loss).all())
    if isinstance(grad_norm, torch.Tensor):
        ok = ok and bool(torch.isfinite(grad_norm).all())
    elif grad_norm is not None:
        ok = ok and math.isfinite(float(grad_norm))
    return ok


class NonFiniteGuard(Callback):
    """See the module docstring. ``check_every``: the loop's check steps (None: only before
    checkpoints and at the end); ``log``: where skipped steps are reported (rank 0)."""

    def __init__(self, mode: str = "stop", max_skips: int = 3, check_every: int | None = None,
                 log: Callable[[str], None] = lambda _: None, check_grad_norm: bool = True):
        if mode not in MODES:
            raise ValueError(f"nonfinite mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode, self.max_skips, self.check_every, self.log = mode, max_skips, check_every, log
        # fp16: DeepSpeed's loss scaler skips overflowing gradients itself; only the loss is judged
        self.check_grad_norm = check_grad_norm
        self.first_bad: torch.Tensor | None = None  # 0-dim int64 on the device
        self.skipped = 0  # steps skipped in all (skip_step)
        self.in_row = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, log: Callable[[str], None]) -> "NonFiniteGuard":
        """The guard of a launch: ``training.nonfinite*``, checked at every ``training.log_every``."""
        return cls(cfg.training.nonfinite, cfg.training.nonfinite_max_skips, check_every=cfg.training.log_every,
                   log=log, check_grad_norm=cfg.precision != "fp16")

    @classmethod
    def from_run(cls, run: RunContext) -> "NonFiniteGuard":
        return cls.from_config(run.cfg, log=run.progress.message)

    def describe(self) -> str:
        """For the end-of-stage line: the steps skip_step skipped, if any."""
        return f" ({self.skipped} non-finite step(s) skipped)" if self.skipped else ""

    @property
    def skips(self) -> bool:
        return self.mode == "skip_step"

    def before_update(self, state: TrainState, check: UpdateCheck) -> int:
        """skip_step: this rank's vote (a host read of its loss, and of its own gradient norm where
        the optimizer keeps none); stop mode reads nothing here."""
        if not self.skips or check.out_of_memory is not None:
            return GO_ON
        return GO_ON if is_finite(check.loss, check.grad_norm()) else SKIP_UPDATE

    def on_step_end(self, state: TrainState, metrics: Mapping[str, object]) -> None:
        """First of the step's callbacks: a skipped step counted (skip_step), or the step's values
        remembered on the device and, at a check step, read with the loss and agreed (stop)."""
        if self.skips:
            self.skipped_step(state.step, state.update_skipped)
            return
        step = cast(_StepValues, metrics)  # the loop's StepMetrics (callbacks never import the loop)
        self.record(state.step, *step.device_values())
        if self.due(state.step, state.total_steps):
            step.watch(self.first_bad)
            step["loss"]  # the one host read of a logging step: loss, grad norm and the guard together
            self.check(step.first_nonfinite)  # before any callback could save this step

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float | None) -> None:
        """Device ops only: remember ``step`` if it is the first non-finite one."""
        bad = ~torch.isfinite(loss.detach()).all()
        if not self.check_grad_norm:
            grad_norm = None
        if isinstance(grad_norm, torch.Tensor):
            bad = bad | ~torch.isfinite(grad_norm.detach().to(bad.device)).all()
        elif grad_norm is not None and not math.isfinite(float(grad_norm)):
            bad = torch.ones_like(bad)
        first = self.first_bad if self.first_bad is not None else torch.full((), NONE, dtype=torch.int64,
                                                                              device=bad.device)
        self.first_bad = torch.where(bad & (first == NONE), torch.full_like(first, step), first)

    def due(self, step: int, total_steps: int) -> bool:
        return self.check_every is not None and (step % self.check_every == 0 or step == total_steps)

    def before_save(self, state: TrainState | None = None) -> None:
        """The hook every checkpoint save runs first (all ranks): never save diverged weights."""
        self.check()

    def check(self, seen: int | None = None) -> None:
        """Raise on every rank when any rank saw a non-finite step. ``seen``: the first bad step
        as already read with the loss (StepMetrics), else it is read here (before a save)."""
        if seen is None:
            seen = int(self.first_bad) if self.first_bad is not None else NONE
        step = host_all_reduce([seen if seen != NONE else UNSEEN], "min")[0]
        if step != UNSEEN:
            raise NonFiniteError(
                f"training diverged: the loss or the gradient norm is not finite at step {step}; the run stops "
                "without saving the diverged weights (the last complete checkpoint is kept: --resume auto "
                "continues from it). Lower optimizer.lr, check the data of that step, or set "
                "training.nonfinite=skip_step to skip such steps")

    def skipped_step(self, step: int, skipped: bool) -> None:
        """skip_step: count a skipped step (or reset the run of them); too many in a row stop."""
        if not skipped:
            self.in_row = 0
            return
        self.skipped += 1
        self.in_row += 1
        self.log(f"step {step}: the loss or the gradient norm is not finite; step skipped (weights unchanged), "
                 f"{self.in_row} in a row, {self.skipped} skipped in all")
        if self.in_row >= self.max_skips:
            raise NonFiniteError(
                f"training diverged: {self.in_row} steps in a row up to step {step} had a non-finite loss or "
                f"gradient norm (training.nonfinite_max_skips={self.max_skips}); the run stops, {self.skipped} step(s) "
                "skipped in all. Lower optimizer.lr or check the data of those steps")

