"""Which smaller micro-batch a step falls back to, and a rank's rows of a step cut at it.

Pure functions: the rows a rank trains in a step are the data's (``DataLoader.micro_batches``,
cut by the plan's layout); the micro-batch in force only splits them finer. Every rank has as
many rows per step, so every rank computes the same fallback.
"""
from __future__ import annotations

import torch

MicroBatches = list[dict[str, torch.Tensor]]


def fitting_sizes(rank_rows: int) -> list[int]:
    """The micro-batches that keep the step exact: the divisors of this rank's rows per step
    (micro_batch x grad_accum x world size stays the global batch), largest first."""
    return [d for d in range(rank_rows, 0, -1) if rank_rows % d == 0]


def smaller_micro_batch(micro_batch: int, rank_rows: int) -> int | None:
    """The next smaller micro-batch that divides ``rank_rows``; None below 1."""
    smaller = [d for d in fitting_sizes(rank_rows) if d < micro_batch]
    return smaller[0] if smaller else None


def rows_of(micro_batches: MicroBatches) -> int:
    return sum(int(mb["input_ids"].shape[0]) for mb in micro_batches)


def recut(micro_batches: MicroBatches, micro_batch: int | None) -> MicroBatches:
    """This rank's rows of the step, in order, cut into micro-batches of ``micro_batch`` rows (None,
    or the cut's own size: unchanged). Every tensor of a micro-batch is cut along its rows."""
    if not micro_batches or micro_batch is None or all(
            int(mb["input_ids"].shape[0]) == micro_batch for mb in micro_batches):
        return micro_batches
    rows = rows_of(micro_batches)
    if rows % micro_batch:
        raise ValueError(f"micro-batch {micro_batch} does not divide this rank's {rows} rows of the step")
    whole = {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]}
    return [{key: value[start:start + micro_batch] for key, value in whole.items()}
            for start in range(0, rows, micro_batch)]
