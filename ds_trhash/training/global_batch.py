"""The global batch: tokens per optimizer step, fixed by the config, split over the ranks at launch.

A stage config states ``batch.global_tokens`` (tokens per optimizer step over all ranks) and
``batch.micro_batch`` (rows per forward on one rank). The gradient accumulation is whatever makes
the two meet on this launch's world size::

    grad_accum = global_tokens / (seq_len * micro_batch * world_size)

so the same file trains the same trajectory on 1 or 48 ranks. A split that does not come out
whole is refused before the model or any directory exists, naming the world size and the
nearest micro-batch / accumulation choices that would work. Without ``global_tokens`` the batch
is per rank (``micro_batch * grad_accum`` rows on every rank), as configs for one fixed world size
may still say.
"""
from __future__ import annotations

from dataclasses import dataclass

from ds_trhash.batch_layout import step_rows, step_tokens

__all__ = ["GlobalBatch", "resolve", "check_static"]


@dataclass(frozen=True)
class GlobalBatch:
    """How one optimizer step is cut for this world size."""

    seq_len: int
    micro_batch: int
    grad_accum: int
    world_size: int
    derived: bool  # grad_accum came from batch.global_tokens

    @property
    def rows(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return step_rows(self.micro_batch, self.grad_accum, self.world_size)

    @property
    def global_tokens(self) -> int:
        return step_tokens(self.micro_batch, self.grad_accum, self.world_size, self.seq_len)

    def describe(self) -> str:
        how = "derived from batch.global_tokens" if self.derived else "per-rank batch"
        return (f"{self.global_tokens:,} tokens per step = seq_len {self.seq_len} x micro_batch {self.micro_batch} "
                f"x grad_accum {self.grad_accum} ({how}) x world {self.world_size}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values: list[int], target: int, count: int = 2) -> list[int]:
    """Up to ``count`` values on each side of ``target``, closest first."""
    below = [v for v in values if v <= target][-count:]
    above = [v for v in values if v > target][:count]
    return sorted(set(below + above), key=lambda v: (abs(v - target), v))


def check_static(seq_len: int, micro_batch: int, grad_accum: int | None, global_tokens: int | None) -> tuple[str, str] | None:
    """What is wrong whatever the world size: (key, problem), or None."""
    if global_tokens is None:
        return None
    if global_tokens % seq_len:
        below, above = global_tokens // seq_len * seq_len, (global_tokens // seq_len + 1) * seq_len
        return ("batch.global_tokens", f"{global_tokens:,} is not a whole number of {seq_len}-token rows "
                                       f"(data.seq_len); nearest: {below:,} or {above:,}")
    rows = global_tokens // seq_len
    if rows % micro_batch:
        ok = _nearest(_divisors(rows), micro_batch)
        return ("batch.micro_batch", f"{micro_batch} does not divide the {rows} rows of batch.global_tokens "
                                     f"{global_tokens:,}; nearest valid micro_batch: {', '.join(map(str, ok))}")
    if grad_accum is not None and (rows // micro_batch) % grad_accum:
        return ("batch.grad_accum", f"{grad_accum} disagrees with batch.global_tokens {global_tokens:,} "
                                    f"({rows} rows = micro_batch {micro_batch} x grad_accum x world size has no "
                                    "whole world size); drop batch.grad_accum (it is derived at launch) or set "
                                    "batch.global_tokens null")
    return None


def resolve(seq_len: int, micro_batch: int, grad_accum: int | None, global_tokens: int | None,
            world_size: int) -> GlobalBatch | tuple[str, str]:
    """The layout on ``world_size`` ranks, or (key, problem) naming what to change."""
    if global_tokens is None:
        return GlobalBatch(seq_len, micro_batch, grad_accum or 1, world_size, derived=False)
    static = check_static(seq_len, micro_batch, grad_accum, global_tokens)
    if static:
        return static
    rows = global_tokens // seq_len
    per_step = step_rows(micro_batch, 1, world_size)  # rows per accumulation step
    if rows % per_step == 0:
        derived = rows // per_step
        if grad_accum is not None and grad_accum != derived:
            return ("batch.grad_accum", f"{grad_accum} disagrees with batch.global_tokens {global_tokens:,} on "
                                        f"world size {world_size}: {seq_len} x {micro_batch} x {grad_accum} x "
                                        f"{world_size} = {step_tokens(micro_batch, grad_accum, world_size, seq_len):,} tokens; drop "
                                        f"batch.grad_accum (derived: {derived} here) or set batch.global_tokens null")
        return GlobalBatch(seq_len, micro_batch, derived, world_size, derived=True)
    head = (f"batch.global_tokens {global_tokens:,} ({rows} rows of {seq_len}) does not split over world size "
            f"{world_size} with micro_batch {micro_batch} ({per_step} rows per accumulation step)")
    if rows % world_size == 0:
        per_rank = rows // world_size
        options = [f"micro_batch {m} (grad_accum {per_rank // m})"
                   for m in _nearest(_divisors(per_rank), micro_batch)]
        return ("batch.micro_batch", f"{head}; nearest valid on {world_size} ranks: {', '.join(options)}")
    worlds = _divisors(rows // micro_batch)
    near = sorted(_nearest(worlds, world_size, 1))
    step = seq_len * per_step  # global_tokens that split over this world size are its multiples
    sizes = sorted({max(step, global_tokens // step * step), (global_tokens // step + 1) * step})
    return ("batch.global_tokens",
            f"{head}; no micro_batch splits {rows} rows over {world_size} ranks: launch on "
            f"{' or '.join(map(str, near))} ranks (any of {', '.join(map(str, worlds))}), or set "
            f"batch.global_tokens to {' or '.join(f'{s:,}' for s in sizes)} for {world_size} ranks")
