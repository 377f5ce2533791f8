"""Adapters from the data layer to the loop's ``StepBatches``: micro-batches as a pure
function of the optimizer step, so an exact resume only needs the step number."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PretrainBatches:
    """Replay-plan rows: step s covers global rows [s·G, (s+1)·G) whatever the world size."""

    reader: object  # ds_trhash.data.reader.ReplayReader
    micro_batch: int
    grad_accum: int
    rank: int
    world_size: int

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for m in range(self.grad_accum):
            inputs, labels = self.reader.batch(
                step, m, self.rank, self.world_size, self.micro_batch, self.grad_accum
            )
            out.append({"input_ids": inputs, "labels": labels})
        return out

    def epoch_of(self, step: int) -> int:
        return 0

    def cursor(self, step: int) -> int:
        """The global row index the next step starts at (saved in checkpoints)."""
        return step * self.micro_batch * self.grad_accum * self.world_size


@dataclass
class SFTStepBatches:
    """Packed SFT windows; epoch e's order is a pure function of (seed, e)."""

    batches: object  # ds_trhash.data.sft_dataset.SFTBatches
    grad_accum: int
    policy: str  # cross_document | per_document

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.batches_per_epoch // self.grad_accum

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        epoch, within = divmod(step, self.steps_per_epoch)
        out = []
        for m in range(self.grad_accum):
            b = dict(self.batches.batch(epoch, within * self.grad_accum + m))
            if self.policy != "per_document":
                # Release behaviour: positions run over the whole window, attention crosses examples.
                b.pop("document_ids", None)
                b.pop("position_ids", None)
            out.append(b)
        return out

    def cursor(self, step: int) -> int:
        return step * self.grad_accum
