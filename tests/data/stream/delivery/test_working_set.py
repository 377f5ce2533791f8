"""Per shard, not per read: once a shard is in a reader's working set, reading its rows makes no
file-system call (counted, with the calls a read used to make patched to count themselves)."""
from __future__ import annotations

import builtins
import fcntl
import io
import mmap
import os
import pathlib
import threading
from collections import Counter

import numpy as np
import pytest

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.delivery import RankStream, ReplayReader
from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.formats.shards import write_shards, load_manifests
from ds_trhash.data.plans.build import build_plan

L, R = 8, 16  # seq_len, rows per shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources of 5 shards of 16 rows; the plan reads all 160 rows, shuffled in windows of 32."""
    root = tmp_path_factory.mktemp("ws")
    for offset, source in ((1, "a"), (3000, "b")):
        write_shards(source, [np.arange(offset, offset + 5 * R * L + 1)], L, R, root, vocab_size=9000,
                     tokenizer_hash="h")
    return root, build_plan(load_manifests([root]), 10 * R * L, dataset="t", revision="1")


class FsCalls:
    """Counts, per thread, every call of the functions a shard read used to go through."""

    def __init__(self, monkeypatch):
        self.by_thread: Counter = Counter()
        self.enabled = False
        for owner, name in [(os, "stat"), (os, "lstat"), (os, "fstat"), (os, "open"), (os, "utime"),
                            (os, "scandir"), (os, "listdir"), (os, "replace"), (os, "unlink"), (builtins, "open"),
                            (io, "open"), (fcntl, "flock"), (mmap, "mmap"), (np, "memmap"),
                            (pathlib.Path, "resolve"), (pathlib.Path, "stat"), (pathlib.Path, "exists")]:
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}"))

    def _wrap(self, fn, label):
        counter = self

        def counted(*args, **kwargs):
            if counter.enabled:
                counter.by_thread[(threading.current_thread().name, label)] += 1
            return fn(*args, **kwargs)

        return counted

    def of(self, thread: str) -> int:
        return sum(n for (name, _), n in self.by_thread.items() if name == thread)


def _micro_batches(layout: BatchLayout, num_rows: int):
    for step in range(num_rows // layout.global_batch):
        for micro in range(layout.grad_accum):
            yield step, micro


@pytest.mark.parametrize("through", ["cache", "cache-prefetch", "directory"])
def test_no_file_system_call_per_micro_batch_once_its_shards_are_in_the_working_set(corpus, tmp_path, monkeypatch,
                                                                                     through):
    root, doc = corpus
    cache = None
    if through != "directory":
        cache = open_corpus(doc, str(root)).open_cache(tmp_path / "cache", 2**30, prefetch=2 if "prefetch" in through else 0)
    reader = ReplayReader(doc, None if cache else root, seed=1, cache=cache, shuffle_window=32)
    layout = BatchLayout(micro_batch=2, grad_accum=2, rank=1, world_size=2)
    calls = FsCalls(monkeypatch)
    looked_at = Counter()  # the prefetcher's looks at a shard (each costs a few dozen calls)
    entry_path = cf.entry_path
    monkeypatch.setattr(cf, "entry_path", lambda *a: looked_at.update([threading.current_thread().name]) or entry_path(*a))
    quiet = entering = 0
    for step, micro in _micro_batches(layout, reader.num_rows):
        opened, before = reader._working.opened, calls.of("MainThread")
        calls.enabled = True
        reader.batch(step, micro, layout)
        calls.enabled = False
        made = calls.of("MainThread") - before
        if reader._working.opened == opened:
            assert made == 0, (step, micro, calls.by_thread)  # every shard of it already in the working set
            quiet += 1
        else:
            assert made > 0  # the counting does see what a shard's entry costs
            entering += reader._working.opened - opened
    assert quiet >= 20 and entering <= 2 * 10  # most micro-batches are quiet; a shard enters at most twice
    if cache is not None:
        assert cache.wait_idle()
        cache.close()
        reads = sum(1 for _ in _micro_batches(layout, reader.num_rows))
        assert looked_at["shard-prefetch"] <= 3 * 10 < reads  # a few looks per shard of the plan, not one per read
    reader.close()


def test_the_training_thread_makes_no_file_system_call_at_all(corpus, tmp_path, monkeypatch):
    """With the background assembly, taking a step's batches is a queue hand-over."""
    root, doc = corpus
    cache = open_corpus(doc, str(root)).open_cache(tmp_path / "cache", 2**30)
    layout = BatchLayout(micro_batch=2, grad_accum=2, rank=0, world_size=2)
    steps = 160 // layout.global_batch
    with RankStream(ReplayReader(doc, None, 1, cache=cache, shuffle_window=32), layout, end=steps) as stream:
        calls = FsCalls(monkeypatch)
        calls.enabled = True
        for step in range(steps):
            stream.micro_batches(step)
        calls.enabled = False
    assert calls.of("MainThread") == 0, calls.by_thread
    assert calls.of("batch-assembly") > 0  # the reading happened, on the assembly thread


def test_a_reader_holds_no_more_than_its_share_of_the_cache(corpus, tmp_path):
    """Two ranks on a node share a bound of two shards: each holds one shard at a time, however
    many its next micro-batches need, so neither waits for room the other holds."""
    root, doc = corpus
    shard_bytes = (R * L + 1) * 2
    caches = [open_corpus(doc, str(root)).open_cache(tmp_path / "cache", 2 * shard_bytes, prefetch=0, ranks_on_node=2)
              for _ in range(2)]
    readers = [ReplayReader(doc, None, 1, cache=c, shuffle_window=32) for c in caches]
    direct = ReplayReader(doc, root, 1, shuffle_window=32)
    for step in range(160 // 4):
        for rank, reader in enumerate(readers):
            layout = BatchLayout(micro_batch=2, grad_accum=1, rank=rank, world_size=2)
            got = reader.batch(step, 0, layout)
            assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, direct.batch(step, 0, layout)))
            assert len(list(caches[rank]._holding)) <= 1
            assert cf.scan(tmp_path / "cache", prune=False)[0] <= 2 * shard_bytes
    for reader, cache in zip(readers, caches):
        reader.close()
        cache.close()
        assert not cache._holding
