"""The node cache's usage ledger: a fill with room reads it instead of walking the directory, and
it never counts fewer bytes than the entries and partial downloads there (fills, evictions, a
corrupt download, a download killed with SIGKILL); a missing or damaged ledger is walked again."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from ds_trhash.data.stream.cache import ShardIntegrityError, files as cf
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.store import LocalStore
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.data.stream.cache.test_shard_cache import KEYS, _slow, cache_for


@pytest.fixture()
def store(tmp_path):
    return write_corpus(tmp_path / "store")


@pytest.fixture()
def walks(monkeypatch):
    """Every directory walk, by the function that made it."""
    made = []
    real_scan = cf.scan_all

    def scan_all(*args, **kwargs):
        made.append("scan")
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(cf, "scan_all", scan_all)
    return made


def ledger(cache_dir):
    return cf.read_usage(cache_dir)


def truth(cache_dir):
    used, entries = cf.scan(cache_dir)
    return used, len(entries)


def test_a_fill_with_room_walks_nothing_and_one_that_must_evict_walks_once(store, tmp_path, walks):
    cache = cache_for(store, tmp_path / "cache", int(3.5 * SHARD_BYTES), prefetch=0)
    assert walks == ["scan"]  # once, as the cache opens
    walks.clear()
    for key in KEYS[:3]:
        cache.get(*key)
    assert walks == [] and ledger(tmp_path / "cache") == (3 * SHARD_BYTES, 3)
    cache.get(*KEYS[3])  # no room left: the truth walked, one entry evicted
    assert walks == ["scan"] and cache.counters()["evictions"] == 1
    assert ledger(tmp_path / "cache") == truth(tmp_path / "cache") == (3 * SHARD_BYTES, 3)
    cache.close()


def test_the_ledger_never_counts_less_than_the_files_through_fills_evictions_and_a_corrupt_download(store, tmp_path):
    cache_dir = tmp_path / "cache"
    cache = cache_for(store, cache_dir, int(2.5 * SHARD_BYTES), prefetch=0)
    for key in KEYS + KEYS[:4]:
        cache.get(*key)
        assert ledger(cache_dir)[0] >= truth(cache_dir)[0]
    assert cache.counters()["evictions"] > 0
    shard = store / "b" / "shard-00003.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[7] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    with pytest.raises(ShardIntegrityError):
        cache.get("b", "shard-00003.bin")
    assert ledger(cache_dir) == truth(cache_dir)  # the refused download's bytes taken off again
    assert not list(cache_dir.rglob("*.partial-*"))
    cache.close()


@pytest.mark.parametrize("damage", ["missing", "not json", "negative", "text"])
def test_a_missing_or_damaged_ledger_is_walked_again(store, tmp_path, walks, damage):
    cache_dir = tmp_path / "cache"
    cache = cache_for(store, cache_dir, 10 * SHARD_BYTES, prefetch=0)
    cache.get(*KEYS[0])
    where = cache_dir / cf.USAGE
    if damage == "missing":
        where.unlink()
    else:
        where.write_text({"not json": "{bytes: 1", "negative": json.dumps({"bytes": -5, "entries": 1}),
                          "text": json.dumps({"bytes": "0", "entries": 0})}[damage])
    walks.clear()
    cache.get(*KEYS[1])
    assert walks == ["scan"]
    assert ledger(cache_dir) == truth(cache_dir) == (2 * SHARD_BYTES, 2)
    cache.close()


def test_an_entry_copied_in_from_outside_is_counted_once_it_is_verified(store, tmp_path):
    cache_dir = tmp_path / "cache"
    first = cache_for(store, cache_dir, 10 * SHARD_BYTES, prefetch=0)
    entry = first.get(*KEYS[0])
    first.close()
    beside = entry.with_name(KEYS[1][1])  # the next shard's bytes under its own name, no marker
    beside.write_bytes((store / KEYS[1][0] / KEYS[1][1]).read_bytes())
    second = cache_for(store, cache_dir, 10 * SHARD_BYTES, prefetch=0)
    assert ledger(cache_dir) == truth(cache_dir) == (SHARD_BYTES, 1)  # not the cache's own until verified
    second.get(*KEYS[1])  # hashed once, marked: an entry from now on
    assert second.counters()["misses"] == 0
    assert ledger(cache_dir) == truth(cache_dir) == (2 * SHARD_BYTES, 2)
    second.close()


def test_a_download_killed_with_sigkill_leaves_the_ledger_counting_more_never_less(store, tmp_path):
    cache_dir = tmp_path / "cache"
    proc = mp.get_context("fork").Process(target=_slow, args=(store, cache_dir))
    proc.start()
    deadline = time.monotonic() + 30
    while not list(cache_dir.rglob("*.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert ledger(cache_dir) == (SHARD_BYTES, 1)  # the partial's bytes, counted before it was written
    assert ledger(cache_dir)[0] >= truth(cache_dir)[0]
    cache = cache_for(store, cache_dir, 10 * SHARD_BYTES, prefetch=0)  # opening walks: the truth again
    assert ledger(cache_dir) == (0, 0) and not list(cache_dir.rglob("*.partial-*"))
    cache.get(*KEYS[0])
    assert ledger(cache_dir) == truth(cache_dir) == (SHARD_BYTES, 1)
    cache.close()


class GatedStore(LocalStore):
    """Writes half of shard ``gated``, then waits for the test to open the gate; other shards as usual."""

    def __init__(self, root, gated: str) -> None:
        super().__init__(root)
        self.gated, self.gate, self.writing = gated, threading.Event(), threading.Event()

    def download(self, path, dest, size):
        if path == self.gated:
            with open(dest, "r+b") as f:
                f.write(b"x" * (size // 2))
            self.writing.set()
            self.gate.wait(30)
        return super().download(path, dest, size)


def test_a_walk_counts_a_download_in_flight_as_the_entry_it_becomes(store, tmp_path):
    cache_dir = tmp_path / "cache"
    gated = GatedStore(store, "/".join(KEYS[1]))
    corpus = open_corpus(plan_for(store), None, store=gated)
    cache = corpus.open_cache(cache_dir, 10 * SHARD_BYTES, prefetch=0)
    cache.get(*KEYS[0])
    reading = threading.Thread(target=cache.get, args=KEYS[1])
    reading.start()
    assert gated.writing.wait(30)
    assert cache.stats()["files"] == 2  # a walk now: the entry and the download that becomes one
    assert ledger(cache_dir) == (2 * SHARD_BYTES, 2)
    gated.gate.set()
    reading.join(30)
    assert ledger(cache_dir) == truth(cache_dir) == (2 * SHARD_BYTES, 2)
    assert cache.counters()["files"] == 2
    cache.close()
