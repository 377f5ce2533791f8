"""Adapters from the data layer to the loop's ``StepBatches``: micro-batches as a pure
function of the optimizer step, so an exact resume only needs the step number."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ds_trhash.batch_layout import step_rows


@dataclass
class PretrainBatches:
    """Replay-plan rows: step s covers global rows [s·G, (s+1)·G) whatever the world size."""

    reader: object  # ds_trhash.data.stream.reader.ReplayReader
    micro_batch: int
    grad_accum: int
    rank: int
    world_size: int
    data_s: float = field(default=0.0, compare=False)  # this process's seconds reading its batches

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        started = time.perf_counter()
        out = []
        for m in range(self.grad_accum):
            inputs, labels = self.reader.batch(
                step, m, self.rank, self.world_size, self.micro_batch, self.grad_accum
            )
            out.append({"input_ids": inputs, "labels": labels})
        self.data_s += time.perf_counter() - started
        return out

    def epoch_of(self, step: int) -> int:
        return 0

    def cursor(self, step: int) -> int:
        """The global row index the next step starts at (saved in checkpoints)."""
        return step * step_rows(self.micro_batch, self.grad_accum, self.world_size)


@dataclass
class SFTStepBatches:
    """Packed SFT windows; epoch e's order is a pure function of (seed, e)."""

    batches: object  # ds_trhash.data.sft.dataset.SFTBatches
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


def data_wait_line(batches: object, step_seconds: float, steps: int) -> str | None:
    """How much of this process's step time went to reading its batches, and how much of that to
    waiting for shard downloads (the node cache's ``waited_s``): the figure that says whether the
    data keeps up with the model. None for batches that are not read from shards."""
    data_s = getattr(batches, "data_s", None)
    if data_s is None or steps < 1:
        return None
    share = 100.0 * data_s / step_seconds if step_seconds > 0 else 0.0
    line = f"data wait on rank {batches.rank}: {data_s:.3f} s of {step_seconds:.3f} s in {steps} step(s) ({share:.1f} %) reading batches"
    cache = getattr(getattr(batches, "reader", None), "cache", None)
    if cache is not None:
        c = cache.stats()
        line += (f"; {c['waited_s']:.3f} s of it waiting for shards ({c['misses']} fetched on demand, "
                 f"{c['prefetched']} prefetched, {c['hits']} cache hits)")
    return line
