"""The batch layout of one optimizer step: the one formula every package uses.

A step is ``grad_accum`` forwards of ``micro_batch`` rows on each of ``world_size`` ranks::

    rows per step   = micro_batch x grad_accum x world_size
    tokens per step = rows per step x seq_len

Training (the config's layout, DeepSpeed's ``train_batch_size``, the data cursor), SFT batching,
the resume checks and the run record compute it here, so no two of them can disagree. Imports
nothing of ours: every package may use it.
"""
from __future__ import annotations


def step_rows(micro_batch: int, grad_accum: int, world_size: int) -> int:
    """Sequences (rows) per optimizer step over all ranks."""
    return micro_batch * grad_accum * world_size


def step_tokens(micro_batch: int, grad_accum: int, world_size: int, seq_len: int) -> int:
    """Token positions per optimizer step over all ranks."""
    return step_rows(micro_batch, grad_accum, world_size) * seq_len


def micro_batch_start(step: int, micro_step: int, rank: int, micro_batch: int, grad_accum: int, world_size: int) -> int:
    """The first global row of rank ``rank``'s micro-step ``micro_step`` of step ``step``: step s
    covers global rows [s·G, (s+1)·G), cut micro-step by micro-step, rank by rank."""
    return step * step_rows(micro_batch, grad_accum, world_size) + (micro_step * world_size + rank) * micro_batch
