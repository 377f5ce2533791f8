"""ProgressCallback: one update per step with the model's backends, the shard cache's counts and
this process's downloads (bytes and average rate, one figure) when the stage streams shards (read
from the stream's figures, never from the cache itself); closing it stops the display and nothing
else (the data layer closes the cache)."""
import re

from ds_trhash.data.stream.delivery import DataFigures
from ds_trhash.training.callbacks import ProgressCallback
from ds_trhash.training.loop import TrainState
from tests.training.callbacks import fakes

FIGURES = DataFigures(rank=0, steps=3, background=True, queue_wait_s=0.0, read_s=0.1, shard_wait_s=0.1, cached=True,
                      fetched=2, prefetched=1, hits=5, evictions=1, downloaded_bytes=3 * 2**20, cache_bytes=3 * 2**20,
                      cache_files=2, max_bytes=8 * 2**20)


def test_updates_carry_loss_lr_backends_and_the_cache_state(tmp_path):
    asked = []
    loader = fakes.Loader(figures=lambda: asked.append(1) or FIGURES)
    cb = ProgressCallback.from_run(fakes.run(tmp_path, loader=loader))
    cb.on_step_end(TrainState(step=3, total_steps=10), fakes.metrics(3, loss=1.5))
    step, loss, lr, tok_s, backends, extra = cb.progress.updates[0]
    # the loss travels as a callable: the display reads it (from the device) only when it shows it
    assert callable(loss) and (step, loss(), lr, tok_s) == (3, 1.5, 1e-3, 100.0)
    assert backends["experts"] == "pytorch"
    assert extra["cache"] == "3.0/8 MiB 2 shards hit 5 miss 2 evict 1" and asked == [1]
    assert re.fullmatch(r"3\.0 MiB at [\d.]+ (GiB|MiB|KiB|B)/s", extra["downloaded"]), extra
    cb.on_end(TrainState(step=10, total_steps=10))
    assert not cb.progress.closed  # the display stays up for what other callbacks' on_end report
    cb.close()
    assert cb.progress.closed


def test_before_any_scan_the_usage_is_unknown_not_walked(tmp_path):
    from dataclasses import replace

    loader = fakes.Loader(figures=lambda: replace(FIGURES, cache_bytes=None, cache_files=None))
    cb = ProgressCallback.from_run(fakes.run(tmp_path, loader=loader))
    cb.on_step_end(TrainState(step=1, total_steps=2), fakes.metrics(1))
    assert cb.progress.updates[0][5]["cache"] == "?/8 MiB ? shards hit 5 miss 2 evict 1"


def test_the_downloads_are_one_figure_averaged_from_the_callbacks_start(tmp_path):
    ticks = iter([100.0, 102.0, 104.0])  # made at 100 s; steps at 102 s and 104 s
    run = fakes.run(tmp_path, loader=fakes.Loader(figures=lambda: FIGURES))
    cb = ProgressCallback(run.progress, run.model, 1, run.loader.figures, clock=lambda: next(ticks))
    cb.on_step_end(TrainState(step=1, total_steps=3), fakes.metrics(1))
    assert cb.progress.updates[0][5]["downloaded"] == "3.0 MiB at 1.5 MiB/s"
    cb.on_step_end(TrainState(step=2, total_steps=3), fakes.metrics(2))
    assert cb.progress.updates[1][5]["downloaded"] == "3.0 MiB at 768.0 KiB/s"


def test_no_cache_no_extra(tmp_path):
    cb = ProgressCallback.from_run(fakes.run(tmp_path))
    cb.on_step_end(TrainState(step=1, total_steps=2), fakes.metrics(1))
    assert cb.progress.updates[0][5] is None
