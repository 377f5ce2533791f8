"""How many optimizer steps a plan allows, TARGET_TOKENS, and token-pack boundaries.

The step count is rounded DOWN: a run never trains a token the plan does not hold (the
public trainer rounded up and overshot by up to one step). Asking for more steps than the
plan holds is refused instead of silently repeating data.
"""
from __future__ import annotations

from typing import Optional, Union

from ds_trhash.errors import UserError

from ds_trhash.data.plans.plan import PlanLike, plan_doc


DEFAULT_PACKS = 40


class BudgetError(UserError, ValueError):
    """A requested step count or token target does not fit the plan."""


def plan_steps(plan: PlanLike, tokens_per_step: int, requested_steps: Optional[int] = None) -> int:
    """Optimizer steps to run: ``requested_steps`` if it fits, else all whole steps of the plan."""
    doc = plan_doc(plan)
    trained, seq_len = int(doc["trained_tokens"]), int(doc["seq_len"])
    if tokens_per_step < 1:
        raise BudgetError(f"tokens_per_step must be positive, got {tokens_per_step}")
    if tokens_per_step % seq_len:
        raise BudgetError(
            f"tokens_per_step {tokens_per_step} is not a whole number of {seq_len}-token rows; "
            "tokens per step = micro_batch x grad_accum x world_size x seq_len"
        )
    available = trained // tokens_per_step
    if available == 0:
        raise BudgetError(
            f"the plan's {trained} trained tokens do not fill one step of {tokens_per_step} tokens; "
            "lower the batch size or use a larger plan"
        )
    if requested_steps is None:
        return available
    if requested_steps < 1:
        raise BudgetError(f"requested steps must be positive, got {requested_steps}")
    if requested_steps > available:
        raise BudgetError(
            f"{requested_steps} steps x {tokens_per_step} tokens exceed the plan's {trained} trained tokens "
            f"({available} whole steps); automatic dataset repetition is forbidden: "
            "add a replay phase to the plan or lower max_steps"
        )
    return requested_steps


def check_target_tokens(plan: PlanLike, value: Union[str, int, None], name: str = "TARGET_TOKENS") -> Optional[int]:
    """Verify a token target against the plan; ``None`` or an empty string means not given.

    ``name`` is where the value came from (the ``TARGET_TOKENS`` variable or the config key
    ``data.target_tokens``), so the message names what the user has to change."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        target = int(value.strip().replace(",", "")) if isinstance(value, str) else int(value)
    except ValueError:
        raise BudgetError(f"{name}={value!r} is not an integer token count") from None
    trained = int(plan_doc(plan)["trained_tokens"])
    if target != trained:
        raise BudgetError(
            f"{name} {target} != the plan's trained_tokens {trained}; "
            f"fix the plan or unset {name}"
        )
    return target


def pack_boundaries(total_steps: int, packs: int = DEFAULT_PACKS) -> list[int]:
    """Steps that end each token pack: ceil(i·total/packs), i = 1..packs, at least one step each."""
    if total_steps < 1 or packs < 1:
        raise BudgetError(f"total_steps ({total_steps}) and packs ({packs}) must be positive")
    packs = min(packs, total_steps)
    boundaries = [-(-i * total_steps // packs) for i in range(1, packs + 1)]
    return sorted(set(boundaries))
