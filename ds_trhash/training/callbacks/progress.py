"""The live progress line (or panel) of rank 0, with the shard cache's state when there is one;
closing it stops the display and the cache."""
from __future__ import annotations

from ds_trhash.training.callbacks.base import Callback, RunContext


class ProgressCallback(Callback):
    def __init__(self, progress, model, every: int, batches=None):
        self.progress, self.model, self.every, self.batches = progress, model, every, batches

    @classmethod
    def from_run(cls, run: RunContext) -> "ProgressCallback":
        return cls(run.progress, run.model, run.cfg.training.log_every, run.batches)

    def on_step_end(self, state, metrics):
        # the loss lazily: read from the device only for a step the progress display shows
        self.progress.update(state.step, lambda: metrics["loss"], metrics["lr"], metrics["tok_s"],
                             backends=self.model.backends_used(), extra=self.extra())

    def _cache(self):
        return getattr(getattr(self.batches, "reader", None), "cache", None)

    def extra(self) -> dict | None:
        """The shard cache's state, when the stage streams shards through one."""
        cache = self._cache()
        if cache is None:
            return None
        st = cache.stats()
        return {"cache": f"{st['bytes'] / 2**20:.1f}/{st['max_bytes'] / 2**20:.0f} MiB {st['files']} shards "
                         f"hit {st.get('hits', 0)} miss {st.get('misses', 0)} evict {st.get('evictions', 0)}"}

    def close(self):
        """The live display stopped (its last state left on screen), and the shard cache it reports
        on closed (its prefetch worker joined)."""
        self.progress.close()
        cache = self._cache()
        if cache is not None:
            cache.close()
