"""The learning-rate schedule: linear warmup, then cosine decay or warmup-stable-decay to a floor
(docs/contracts.md §6, §6b).

One family of formulas for every stage, so a pretraining, refinement or SFT run differs only in
its numbers. The schedule is a pure function of the optimizer step, which is what makes an exact
resume possible: ``LambdaLR`` stores only ``last_epoch`` (the step) in its state dict.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from ds_trhash.config_fields import closed_unit, half_open_unit, non_negative, optional, positive, setting

__all__ = ["DEFAULT_WARMUP_FRACTION", "KINDS", "ScheduleSection", "warmup_steps_for", "warmup_steps_from_tokens",
           "schedule_warmup_steps", "lr_factor", "describe_schedule", "build_scheduler"]

KINDS = ("cosine", "wsd")
# docs/contracts.md §6: W = int(0.03 * H) unless a config says otherwise.
DEFAULT_WARMUP_FRACTION = 0.03


@dataclass(frozen=True)
class ScheduleSection:
    """The config's ``schedule:`` section (the YAML keys are these field names)."""

    # cosine: warmup then one cosine to the floor; wsd: warmup, a stable peak, then a cosine over the
    # last (1 - stable_fraction) of the post-warmup steps (lr_factor below).
    kind: Literal["cosine", "wsd"] = "cosine"
    # W = int(fraction * H); null means DEFAULT_WARMUP_FRACTION unless warmup_tokens is set.
    warmup_fraction: float | None = setting(None, check=optional(half_open_unit))
    # The warmup in tokens instead: W = ceil(warmup_tokens / tokens per step). Exclusive with
    # warmup_fraction (checks.py), so a dumped config (both keys written) loads back.
    warmup_tokens: int | None = setting(None, check=optional(positive))
    # LR factor the warmup line starts from (0: the first step is at peak / W).
    warmup_start_factor: float = setting(0.0, check=half_open_unit)
    stable_fraction: float = setting(0.8, check=half_open_unit)
    min_warmup_steps: int = setting(1, check=non_negative)
    floor: float = setting(0.1, check=closed_unit)

    @property
    def fraction(self) -> float | None:
        """The warmup fraction in force: None when the warmup is given in tokens."""
        if self.warmup_tokens is not None:
            return None
        return DEFAULT_WARMUP_FRACTION if self.warmup_fraction is None else self.warmup_fraction


def warmup_steps_for(total_steps: int, fraction: float = 0.03, minimum: int = 1) -> int:
    """W = max(minimum, int(fraction * H)), never more than H.

    The cap only matters for tiny runs: a warmup longer than the run would never reach the
    peak learning rate.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= fraction < 1:
        raise ValueError(f"warmup fraction must be in [0, 1), got {fraction}")
    if minimum < 0:
        raise ValueError(f"minimum warmup steps must be >= 0, got {minimum}")
    return min(total_steps, max(minimum, int(fraction * total_steps)))


def warmup_steps_from_tokens(total_steps: int, warmup_tokens: int, tokens_per_step: int, minimum: int = 1) -> int:
    """W = max(minimum, ceil(warmup_tokens / tokens_per_step)), never more than H.

    A warmup given in tokens keeps its length in data when the batch changes; rounding up means
    at least ``warmup_tokens`` tokens are seen before the peak (1B tokens at 786,432 a step: 1,272).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_tokens < 0 or tokens_per_step < 1:
        raise ValueError(f"need warmup_tokens >= 0 and tokens_per_step >= 1, got {warmup_tokens}, {tokens_per_step}")
    return min(total_steps, max(minimum, -(-warmup_tokens // tokens_per_step)))


def schedule_warmup_steps(schedule: ScheduleSection, total_steps: int, tokens_per_step: int | None) -> int:
    """W of a ``schedule`` config section: from ``warmup_tokens`` when set, else its warmup fraction."""
    tokens = schedule.warmup_tokens
    if tokens is None:
        fraction = schedule.fraction
        if fraction is None:  # None only beside warmup_tokens
            raise ValueError("schedule: neither a warmup fraction nor warmup_tokens")
        return warmup_steps_for(total_steps, fraction, schedule.min_warmup_steps)
    if tokens_per_step is None:
        raise ValueError("schedule.warmup_tokens needs the tokens per optimizer step to size the warmup")
    return warmup_steps_from_tokens(total_steps, tokens, tokens_per_step, schedule.min_warmup_steps)


def _cosine(progress: float, floor: float) -> float:
    """From 1 (progress 0) down to ``floor`` (progress 1) along half a cosine."""
    return floor + (1.0 - floor) / 2.0 * (1.0 + math.cos(math.pi * progress))


def lr_factor(step: int, total_steps: int, warmup_steps: int, floor: float = 0.1, *, kind: str = "cosine",
              warmup_start: float = 0.0, stable_fraction: float = 0.8) -> float:
    """Multiplier of the peak LR for 0-based optimizer ``step`` of ``total_steps`` (H).

    With s = step + 1 and W = warmup_steps:
    - warmup (s <= W): warmup_start + (1 - warmup_start) * s / W, a line from ``warmup_start``
      (before the first step) to 1 at the last warmup step; warmup_start 0 gives s / W.
    - ``cosine``: floor + (1 - floor) / 2 * (1 + cos(pi * (s - W) / (H - W))). With floor 0.1 this
      is docs/contracts.md §6: 0.1 + 0.45 * (1 + cos(...)).
    - ``wsd`` (warmup-stable-decay): of the R = H - W post-warmup steps, the first
      S = int(stable_fraction * R) stay at 1, the last R - S follow the same cosine over their own
      length: floor + (1 - floor) / 2 * (1 + cos(pi * (s - W - S) / (R - S))).
    Either way the last step (s = H) lands exactly on the floor, and steps past the end stay
    there rather than climbing back up the cosine.
    """
    if kind not in KINDS:
        raise ValueError(f"schedule kind {kind!r} is not supported; allowed: {', '.join(KINDS)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, {total_steps}], got {warmup_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    s = step + 1
    if s <= warmup_steps:
        return warmup_start + (1.0 - warmup_start) * s / warmup_steps
    if s >= total_steps:  # also covers H == W, where the decay has no length
        return floor
    after, remaining = s - warmup_steps, total_steps - warmup_steps  # after in [1, R)
    if kind == "cosine":
        return _cosine(after / remaining, floor)
    stable = int(stable_fraction * remaining)
    if after <= stable:
        return 1.0
    return _cosine((after - stable) / (remaining - stable), floor)


def describe_schedule(schedule: ScheduleSection, total_steps: int, tokens_per_step: int, peak_lr: float) -> str:
    """One line for the startup summary: the phases in steps, so a log shows the recipe it ran."""
    warmup = schedule_warmup_steps(schedule, total_steps, tokens_per_step)
    sized = (f"{schedule.warmup_tokens:,} tokens" if schedule.warmup_tokens is not None
             else f"{schedule.fraction:g} of the run")
    start = schedule.warmup_start_factor
    text = f"{schedule.kind}: warmup {warmup:,} steps ({sized}){f' from {start:g} x peak' if start else ''}, peak {peak_lr:g}"
    remaining = total_steps - warmup
    floor = f"{schedule.floor:g} x peak at step {total_steps:,}"
    if schedule.kind == "wsd":
        stable = int(schedule.stable_fraction * remaining)
        return f"{text} for {stable:,} more steps, then a cosine over {remaining - stable:,} steps to {floor}"
    return f"{text}, then a cosine over {remaining:,} steps to {floor}"


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, schedule: ScheduleSection,
                    tokens_per_step: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``total_steps`` optimizer steps; DeepSpeed calls ``.step()`` after each.

    ``schedule`` is the ``schedule`` section of the training config; ``tokens_per_step``
    (token positions of one optimizer step over all ranks) sizes a warmup given in tokens. The
    lambda is a ``functools.partial`` of a module-level function, so the scheduler's state dict
    holds no closure and ``load_state_dict`` restores the step exactly.
    """
    if schedule.kind not in KINDS:
        raise ValueError(f"schedule.kind {schedule.kind!r} is not supported; allowed: {', '.join(KINDS)}")
    warmup = schedule_warmup_steps(schedule, total_steps, tokens_per_step)
    fn = functools.partial(lr_factor, total_steps=total_steps, warmup_steps=warmup, floor=schedule.floor,
                           kind=schedule.kind, warmup_start=schedule.warmup_start_factor,
                           stable_fraction=schedule.stable_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=fn)
