"""The batch layout of one optimizer step: the one formula every package uses.

A step is ``grad_accum`` forwards of ``micro_batch`` rows on each of ``world_size`` ranks::

    rows per step   = micro_batch x grad_accum x world_size
    tokens per step = rows per step x seq_len

Training (the config's layout, DeepSpeed's ``train_batch_size``, the data cursor), SFT batching,
the resume checks and the run record compute it here, so no two of them can disagree. One
rank's part of it travels as a ``BatchLayout`` (micro-batch, accumulation, rank, world size, by
name). Imports nothing of ours: every package may use it.
"""
from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class BatchLayout:
    """How one rank cuts the global batch: step s covers global rows [s·G, (s+1)·G) whatever the
    world size, and this rank reads ``micro_batch`` of them at each of its ``grad_accum``
    micro-steps (``micro_batch_start``). How the stream, the row exchange and the launch pass the
    layout around (one order of its numbers, named)."""
    micro_batch: int
    grad_accum: int
    rank: int
    world_size: int

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over all ranks (G)."""
        return step_rows(self.micro_batch, self.grad_accum, self.world_size)

    def first_row(self, step: int, micro_step: int) -> int:
        """The first global row of this rank's micro-step ``micro_step`` of step ``step``."""
        return micro_batch_start(step, micro_step, self.rank, self.micro_batch, self.grad_accum, self.world_size)
