"""ProgressCallback: one update per step with the model's backends, the shard cache when there is one;
closing it stops the display and the cache."""
from types import SimpleNamespace

from ds_trhash.training.callbacks import ProgressCallback
from ds_trhash.training.loop import TrainState
from tests.training.callbacks import fakes


class Cache:
    closed = False

    def close(self):
        self.closed = True

    def stats(self):
        return {"bytes": 3 * 2**20, "max_bytes": 8 * 2**20, "files": 2, "hits": 5, "misses": 2, "evictions": 1}


def test_updates_carry_loss_lr_backends_and_the_cache_state(tmp_path):
    batches = SimpleNamespace(reader=SimpleNamespace(cache=Cache()))
    cb = ProgressCallback.from_run(fakes.run(tmp_path, batches=batches))
    cb.on_step_end(TrainState(step=3, total_steps=10), fakes.metrics(3, loss=1.5))
    step, loss, lr, tok_s, backends, extra = cb.progress.updates[0]
    # the loss travels as a callable: the display reads it (from the device) only when it shows it
    assert callable(loss) and (step, loss(), lr, tok_s) == (3, 1.5, 1e-3, 100.0)
    assert backends["experts"] == "pytorch"
    assert extra == {"cache": "3.0/8 MiB 2 shards hit 5 miss 2 evict 1"}
    cb.on_end(TrainState(step=10, total_steps=10))
    assert not cb.progress.closed  # the display stays up for what other callbacks' on_end report
    cb.close()
    assert cb.progress.closed and batches.reader.cache.closed


def test_no_cache_no_extra(tmp_path):
    cb = ProgressCallback.from_run(fakes.run(tmp_path))
    cb.on_step_end(TrainState(step=1, total_steps=2), fakes.metrics(1))
    assert cb.progress.updates[0][5] is None
