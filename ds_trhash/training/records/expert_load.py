"""``expert_load.csv``: how many token routes each expert of each layer received, per logged step.

TR-HASH routing is fixed by the token-id hash table, so the load follows the token mix of the
data; a stage whose data leans on a few token ids shows it here first. Every logged step adds
one row per layer with the routes counted over every rank since the previous row:

    step, from_step, layer, expert_0 ... expert_{E-1}

covering the optimizer steps ``from_step + 1 .. step`` (an exact resume at a step that was not
logged starts its first interval there, so ``from_step`` says what each row covers). Each token
has two routes (top-2), so a row's counts sum to 2 x the tokens of those steps, padding
included: padded positions go through the experts like any other. Rows are counts, not shares,
so intervals of any length add up.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ds_trhash.ranks import is_multi_rank
from ds_trhash.training.records.csv_log import CsvLog
from ds_trhash.training.records.files import EXPERT_LOAD_FILE

if TYPE_CHECKING:
    from ds_trhash.model.transformer import TRHashForCausalLM

__all__ = ["EXPERT_LOAD_FILE", "ExpertLoadWriter", "columns", "gather_expert_load", "load_shares"]



def columns(num_experts: int) -> tuple[str, ...]:
    return ("step", "from_step", "layer", *(f"expert_{e}" for e in range(num_experts)))


def gather_expert_load(model: TRHashForCausalLM, device: torch.device) -> torch.Tensor | None:
    """The [L, E] route counts since the last call, summed over every rank (all ranks call this
    at the same steps: it is a collective); None when the model counted nothing."""
    counts = model.take_expert_load()
    if counts is None:
        return None
    counts = counts.to(device=device, dtype=torch.int64)
    if is_multi_rank():
        dist.all_reduce(counts)
    return counts.cpu()


def load_shares(counts: torch.Tensor) -> dict[str, float]:
    """Monitor events: each expert's share of its layer's routes."""
    shares = counts.double() / counts.sum(dim=1, keepdim=True).clamp_min(1).double()
    return {f"Experts/layer_{i:02d}/expert_{e}": float(shares[i, e])
            for i in range(shares.shape[0]) for e in range(shares.shape[1])}


class ExpertLoadWriter:
    """Rank 0 appends one row per layer at each logged step (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, num_experts: int, rank: int, resume_step: int | None = None):
        self.num_experts = num_experts
        self._log = CsvLog(path, columns(num_experts), rank, resume_step)

    def write(self, step: int, from_step: int, counts: torch.Tensor) -> None:
        if counts.dim() != 2 or counts.shape[1] != self.num_experts:
            raise ValueError(f"expert load counts must be [layers, {self.num_experts}], got {list(counts.shape)}")
        self._log.append([[str(step), str(from_step), str(layer), *(str(int(c)) for c in row)]
                          for layer, row in enumerate(counts.tolist())])

    def close(self) -> None:
        self._log.close()
