"""One deadline per read (``deadline``): what is left never goes below zero and is spent once
the moment passes, an inner deadline never outlives an outer one, the deadline is the thread's
own and is put back however the block ends, and a wait below a read (here the cache's wait for
room) ends with it. The download-lock wait is tested in test_cache.py."""
from __future__ import annotations

import threading
import time

import pytest

from ds_trhash.data.stream.cache import CacheError, files as cf
from ds_trhash.data.stream import deadline
from tests.data.hub_corpus import SHARD_BYTES, write_corpus
from tests.data.stream.cache.test_shard_cache import _entries, cache_for


def test_without_a_deadline_each_wait_keeps_its_own_budget():
    assert deadline.remaining() is None and deadline.budget() is None
    assert deadline.capped(600.0) == 600.0
    with deadline.read_deadline(None):
        assert deadline.remaining() is None and deadline.capped(5.0) == 5.0


def test_what_is_left_shrinks_never_goes_below_zero_and_caps_every_wait():
    with deadline.read_deadline(30.0):
        left = deadline.remaining()
        assert 0 < left <= 30.0 and deadline.budget() == 30.0
        assert deadline.capped(1.0) == 1.0  # a shorter wait keeps its own
        assert deadline.capped(600.0) <= left  # a longer one ends with the read
    with deadline.read_deadline(0.05):
        time.sleep(0.1)  # the moment has passed
        assert deadline.remaining() == 0.0 and deadline.capped(600.0) == 0.0
    with deadline.read_deadline(-3.0):  # a budget below zero is spent at once, not a time in the past
        assert deadline.remaining() == 0.0
    assert deadline.remaining() is None and deadline.budget() is None


def test_an_inner_deadline_never_outlives_the_outer_one():
    with deadline.read_deadline(0.5):
        with deadline.read_deadline(100.0):  # later than the outer one: the outer one is kept
            assert deadline.remaining() <= 0.5 and deadline.budget() == 0.5
        with deadline.read_deadline(None):
            assert deadline.remaining() <= 0.5 and deadline.budget() == 0.5
        with deadline.read_deadline(0.1):  # sooner: it holds inside its block only
            assert deadline.remaining() <= 0.1 and deadline.budget() == 0.1
        assert 0.1 < deadline.remaining() <= 0.5 and deadline.budget() == 0.5
    assert deadline.remaining() is None


def test_the_deadline_is_the_threads_own_and_put_back_when_the_block_raises():
    seen = []
    with deadline.read_deadline(10.0):
        other = threading.Thread(target=lambda: seen.append((deadline.remaining(), deadline.budget())))
        other.start()
        other.join()
        with pytest.raises(OSError):
            with deadline.read_deadline(1.0):
                raise OSError("disk gone")
        assert deadline.budget() == 10.0
    assert seen == [(None, None)]  # a prefetch thread beside a read keeps its own budgets
    assert deadline.remaining() is None and deadline.budget() is None


def test_a_read_waits_for_room_in_the_cache_no_longer_than_its_deadline(tmp_path):
    """Another reader holds the only shard the cache has room for: without a deadline the read
    would wait up to ten minutes for room; with one of 0.3 s it fails after about that, and no
    entry, partial or ledger changed."""
    store = write_corpus(tmp_path / "store")
    holder = cache_for(store, tmp_path / "cache", SHARD_BYTES, prefetch=0)  # room for one shard
    reader = cache_for(store, tmp_path / "cache", SHARD_BYTES, prefetch=0)
    def entries():  # the shard's download lock file is kept beside it, as every download keeps it
        return {name: digest for name, digest in _entries(tmp_path / "cache").items() if not name.endswith(cf.LOCK)}

    with holder.held("a", "shard-00000.bin") as held:
        before = entries()
        started = time.monotonic()
        with pytest.raises(CacheError, match="no room for shard-00001.bin in the cache"):
            with deadline.read_deadline(0.3):
                reader.get("a", "shard-00001.bin")
        assert 0.25 < time.monotonic() - started < 10
        assert held.exists() and entries() == before
    reader.close()
    holder.close()

