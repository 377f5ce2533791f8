"""The live progress line (or panel) of rank 0, with the shard cache's counts and this process's
downloads (bytes and average rate: one figure for all of them, no line or bar per file) when the
stage streams its shards; closing it stops the display (the data layer closes the cache)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ds_trhash.training.callbacks.base import Callback, Metrics, RunContext, TrainState
from ds_trhash.training.display import downloaded

if TYPE_CHECKING:
    from ds_trhash.data.stage import DataFigures
    from ds_trhash.model.transformer import TRHashForCausalLM
    from ds_trhash.training.display import Progress


class ProgressCallback(Callback):
    def __init__(self, progress: Progress, model: TRHashForCausalLM, every: int, figures: Callable[[], DataFigures | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``figures``: the loader's ``figures`` (the stream's ``DataFigures``, or None), read per step;
        ``clock``: the download rate is averaged from this callback's start (the launch's steps)."""
        self.progress, self.model, self.every, self.figures = progress, model, every, figures
        self.clock, self.started = clock, clock()

    @classmethod
    def from_run(cls, run: RunContext) -> "ProgressCallback":
        return cls(run.progress, run.model, run.cfg.training.log_every, run.loader.figures)

    def on_step_end(self, state: TrainState, metrics: Metrics) -> None:
        # the loss lazily: read from the device only for a step the progress display shows;
        # tokens/s: the launch's steady rate so far (training.throughput), this step's own before it
        steady = state.throughput.rate
        self.progress.update(state.step, lambda: metrics["loss"], metrics["lr"],
                             steady if steady is not None else metrics["tok_s"],
                             backends=self.model.backends_used(), extra=self.extra())

    def extra(self) -> dict | None:
        """The shard cache's state, when the stage streams shards through one: this process's
        counts and downloads, and the usage its last scan saw (nothing walked, no lock taken, per step)."""
        f = self.figures() if self.figures is not None else None
        if f is None or not f.cached:
            return None
        usage = "?" if f.cache_bytes is None else f"{f.cache_bytes / 2**20:.1f}"
        files = "?" if f.cache_files is None else f.cache_files
        limit = "?" if f.max_bytes is None else f"{f.max_bytes / 2**20:.0f}"
        return {"cache": f"{usage}/{limit} MiB {files} shards "
                         f"hit {f.hits} miss {f.fetched} evict {f.evictions}",
                "downloaded": downloaded(f, self.clock() - self.started)}

    def close(self) -> None:
        """The live display stopped (its last state left on screen)."""
        self.progress.close()
