"""Adapters from the data layer to the loop's ``StepBatches``: micro-batches as a pure
function of the optimizer step, so an exact resume only needs the step number."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_trhash.data.stream.steps import DataFigures, RankStream


@dataclass
class PretrainBatches:
    """Replay-plan rows: step s covers global rows [s·G, (s+1)·G) whatever the world size. The
    stream (data layer) assembles them and owns the reading's lifetime; the launch closes it."""

    stream: RankStream

    @property
    def rank(self) -> int:
        return self.stream.layout.rank

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        return [{"input_ids": inputs, "labels": labels} for inputs, labels in self.stream.micro_batches(step)]

    def epoch_of(self, step: int) -> int:
        return 0

    def cursor(self, step: int) -> int:
        """The global row index the next step starts at (saved in checkpoints)."""
        return step * self.stream.layout.global_batch

    def data_figures(self) -> DataFigures:
        return self.stream.figures()

    def readiness(self, step: int) -> tuple[int, int, int]:
        """Before ``step``: whether this rank's data is still being read (the stop agreement asks)."""
        return self.stream.readiness(step)

    def agreed(self, step: int, status: int, node: int) -> None:
        self.stream.agreed(step, status, node)


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

    def data_figures(self) -> None:
        return None  # packed in memory: nothing streamed


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f} %" if whole > 0 else "0.0 %"


def byte_size(n: float) -> str:
    """Bytes for people, in the largest binary unit that keeps them at least 1 ("3.2 GiB", "512 B")."""
    for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def downloaded(figures: DataFigures, seconds: float) -> str:
    """This process's downloads in one figure: the bytes of the shards it downloaded and verified
    (on demand and prefetched) and their average rate over ``seconds`` ("42.0 MiB at 1.1 MiB/s")."""
    rate = f" at {byte_size(figures.downloaded_bytes / seconds)}/s" if seconds > 0 else ""
    return f"{byte_size(figures.downloaded_bytes)}{rate}"


def data_wait_line(figures: DataFigures | None, step_seconds: float, steps: int) -> str | None:
    """Whether the data keeps up with the model, in parts that add up: of the step time, the
    seconds the training thread waited for its batches; apart from it (in the background, or
    inside that wait when assembling on the training thread), the seconds assembling them took,
    split into reading rows and waiting for shards, with the node cache's counts and the bytes
    downloaded (the one line that reports a streamed stage's downloads). None for batches that
    are not streamed from shards."""
    if figures is None or steps < 1:
        return None
    f, assembly = figures, figures.assembly_s
    where = "in the background" if f.background else "on the training thread, inside that wait"
    line = (f"data wait on rank {f.rank}: {f.queue_wait_s:.3f} s of {step_seconds:.3f} s in {steps} step(s) "
            f"({_share(f.queue_wait_s, step_seconds)}) waiting for batches; assembling them took {assembly:.3f} s "
            f"{where}: {f.read_s:.3f} s reading rows ({_share(f.read_s, assembly)}), {f.shard_wait_s:.3f} s "
            f"waiting for shards ({_share(f.shard_wait_s, assembly)})")
    if f.cached:
        line += (f" ({f.fetched} fetched on demand, {f.prefetched} prefetched, {f.hits} cache hits; "
                 f"downloaded {downloaded(f, step_seconds)})")
    return line
