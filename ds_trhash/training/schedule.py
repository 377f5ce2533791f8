"""The learning-rate schedule: linear warmup, then cosine decay to a floor (docs/contracts.md §6).

One formula for every stage, so a pretraining, refinement or SFT run differs only in its
numbers. The schedule is a pure function of the optimizer step, which is what makes an exact
resume possible: ``LambdaLR`` stores only ``last_epoch`` (the step) in its state dict.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

__all__ = ["warmup_steps_for", "lr_factor", "build_scheduler"]


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


def lr_factor(step: int, total_steps: int, warmup_steps: int, floor: float = 0.1) -> float:
    """Multiplier of the peak LR for 0-based optimizer ``step`` of ``total_steps`` (H).

    With s = step + 1 and W = warmup_steps: s / W while s <= W, else
    floor + (1 - floor) / 2 * (1 + cos(pi * (s - W) / (H - W))). With floor 0.1 this is the
    docs/contracts.md §6: 0.1 + 0.45 * (1 + cos(...)); the last step (s = H) lands exactly on the floor.
    Steps past the end stay at the floor rather than climbing back up the cosine.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps must be in [0, {total_steps}], got {warmup_steps}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    s = step + 1
    if s <= warmup_steps:
        return s / warmup_steps
    if s >= total_steps:  # also covers H == W, where the cosine has no length
        return floor
    progress = (s - warmup_steps) / (total_steps - warmup_steps)
    return floor + (1.0 - floor) / 2.0 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, schedule_cfg: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``total_steps`` optimizer steps; DeepSpeed calls ``.step()`` after each.

    ``schedule_cfg`` is the ``schedule`` section of the training config. The lambda is a
    ``functools.partial`` of a module-level function, so the scheduler's state dict holds no
    closure and ``load_state_dict`` restores the step exactly.
    """
    if schedule_cfg.kind != "cosine":
        raise ValueError(f"schedule.kind {schedule_cfg.kind!r} is not supported; allowed: cosine")
    warmup = warmup_steps_for(total_steps, schedule_cfg.warmup_fraction, schedule_cfg.min_warmup_steps)
    fn = functools.partial(lr_factor, total_steps=total_steps, warmup_steps=warmup, floor=schedule_cfg.floor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=fn)

