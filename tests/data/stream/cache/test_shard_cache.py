"""The node cache over a local store: the bound, LRU eviction, holds, markers, several processes
sharing one directory, a download killed with SIGKILL, names that would escape the directory."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from ds_trhash.data.stream.cache import CacheError, ExpectedShard, ShardCache, ShardIntegrityError, files as cf
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.store import LocalStore
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.fail_closed import tree_digest

KEYS = [("a", f"shard-{i:05d}.bin") for i in range(6)] + [("b", f"shard-{i:05d}.bin") for i in range(6)]


@pytest.fixture()
def store(tmp_path):
    return write_corpus(tmp_path / "store")


def cache_for(root, cache_dir, limit, prefetch=2):
    return open_corpus(plan_for(root), str(root)).open_cache(cache_dir, limit, prefetch=prefetch)


def entry_bytes(directory):
    return cf.scan(directory)[0]


def test_get_copies_verifies_and_then_hits(store, tmp_path):
    cache = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)
    path = cache.get("a", "shard-00002.bin")
    assert path.read_bytes() == (store / "a" / "shard-00002.bin").read_bytes()
    assert path.parent.parent.parent == tmp_path / "cache" and cf.read_marker(path)["bytes"] == SHARD_BYTES
    assert cache.get("a", "shard-00002.bin") == path
    stats = cache.stats()
    assert (stats["bytes"], stats["files"], stats["hits"], stats["misses"]) == (SHARD_BYTES, 1, 1, 1)
    with pytest.raises(CacheError, match="not in that source's manifest"):
        cache.get("a", "shard-00099.bin")
    cache.close()


def test_bound_is_never_exceeded_and_the_least_recently_used_goes_first(store, tmp_path):
    limit = int(2.5 * SHARD_BYTES)
    cache = cache_for(store, tmp_path / "cache", limit, prefetch=0)
    for key in KEYS:
        cache.get(*key)
        assert entry_bytes(tmp_path / "cache") <= limit
    assert cache.stats()["evictions"] == 10 and cache.stats()["files"] == 2
    cache.get("a", "shard-00000.bin")  # evicts b/4 (b/5 was used later)
    cache.get("b", "shard-00005.bin")
    names = {(p.parent.name, p.name) for p in (tmp_path / "cache").rglob("*.bin")}
    assert names == {("a", "shard-00000.bin"), ("b", "shard-00005.bin")}
    cache.close()


def test_a_held_shard_is_never_evicted(store, tmp_path):
    cache = cache_for(store, tmp_path / "cache", SHARD_BYTES, prefetch=0)
    with cache.held("a", "shard-00000.bin") as path:
        other = cache_for(store, tmp_path / "cache", SHARD_BYTES, prefetch=1)  # no room to hold a prefetch
        other.prefetch([("a", "shard-00001.bin")])  # a prefetch finds no room and gives up
        assert other.wait_idle() and path.exists() and other.stats()["prefetched"] == 0
        other.close()
    cache.get("a", "shard-00001.bin")  # no longer held: evicted for the next one
    assert not path.exists() and cache.stats()["evictions"] == 1


def test_shard_larger_than_the_cache_is_a_clear_error(store, tmp_path):
    cache = cache_for(store, tmp_path / "cache", SHARD_BYTES - 1)
    with pytest.raises(CacheError, match="larger than the whole cache"):
        cache.get("a", "shard-00000.bin")


def test_corrupt_shard_is_refused_and_never_cached(store, tmp_path):
    cache = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)  # manifests read before the damage
    shard = store / "a" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardIntegrityError, match="shard a/shard-00001.bin from .*two downloads hashed"):
        cache.get("a", "shard-00001.bin")
    assert not list((tmp_path / "cache").rglob("shard-00001.bin")) and cache.stats()["redownloads"] == 1
    cache.prefetch([("a", "shard-00001.bin")])
    assert cache.wait_idle()
    with pytest.raises(ShardIntegrityError):  # a prefetch's corrupt shard stops the next read
        cache.get("a", "shard-00000.bin")
    cache.close()


def test_markers_spare_a_later_run_the_hashing_and_catch_a_changed_entry(store, tmp_path):
    first = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)
    local = first.get("b", "shard-00000.bin")
    first.close()
    data = bytearray(local.read_bytes())
    data[4] ^= 0x01  # same size, new mtime: the marker no longer describes it
    local.write_bytes(bytes(data))
    second = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)
    assert second.get("b", "shard-00000.bin").read_bytes() == (store / "b" / "shard-00000.bin").read_bytes()
    assert second.stats()["misses"] == 1
    second.get("b", "shard-00000.bin")
    assert second.stats()["hits"] == 1
    second.close()


def _reader(root, cache_dir, limit, keys, samples):
    cache = cache_for(root, cache_dir, limit)
    for key in keys:
        with cache.held(*key) as path:
            assert path.stat().st_size == SHARD_BYTES
        cache.prefetch(keys[keys.index(key) + 1:])
        samples.put(cache.usage())
    cache.close()


class CountingStore(LocalStore):
    """Counts downloads in a file (appends are atomic across processes)."""

    log = None

    def download(self, path, dest, size):
        with open(self.log, "a") as f:
            f.write(path + "\n")
        time.sleep(0.02)
        super().download(path, dest, size)


def _counting_reader(root, cache_dir, log, keys):
    CountingStore.log = log
    corpus = open_corpus(plan_for(root), None, store=CountingStore(root))
    with ShardCache(corpus.store, cache_dir, 100 * SHARD_BYTES, corpus.shards, commit=corpus.commit) as cache:
        for key in keys:
            cache.get(*key)
    # same identity as a LocalStore of root, so one folder


def test_four_processes_download_each_shard_once_and_stay_in_bound(store, tmp_path):
    ctx = mp.get_context("fork")
    log = tmp_path / "downloads.log"
    procs = [ctx.Process(target=_counting_reader, args=(store, tmp_path / "cache", log, KEYS)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sorted(log.read_text().split()) == sorted(f"{s}/{f}" for s, f in KEYS)  # once per node
    limit = 4 * SHARD_BYTES
    samples = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(store, tmp_path / "small", limit, KEYS, samples)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 3
    seen = [samples.get() for _ in range(3 * len(KEYS))]
    assert max(seen) <= limit


class SlowStore(LocalStore):
    def download(self, path, dest, size):
        with open(dest, "r+b") as f:
            f.write(b"x" * (size // 2))
            f.flush()
        time.sleep(60)


def _slow(root, cache_dir):
    store = SlowStore(root)
    corpus = open_corpus(plan_for(root), None, store=store)
    ShardCache(store, cache_dir, 10 * SHARD_BYTES, corpus.shards, commit=corpus.commit).get("a", "shard-00000.bin")


def test_sigkill_mid_download_leaves_nothing_trusted(store, tmp_path):
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_slow, args=(store, tmp_path / "cache"))
    proc.start()
    deadline = time.monotonic() + 30
    while not list((tmp_path / "cache").rglob("*.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert list((tmp_path / "cache").rglob("*.partial-*"))
    cache = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)
    assert cache.get("a", "shard-00000.bin").read_bytes() == (store / "a" / "shard-00000.bin").read_bytes()
    assert not list((tmp_path / "cache").rglob("*.partial-*")) and cache.stats()["misses"] == 1
    cache.close()


@pytest.mark.parametrize("source, file", [("..", "x.bin"), ("a", "../../victim.bin"), ("a", "/etc/passwd"),
                                          ("a", ".hidden"), ("a", "shard.bin.lock")])
def test_names_that_would_leave_the_cache_are_refused_before_anything_is_written(store, tmp_path, source, file):
    before = tree_digest(tmp_path)
    victim = {(source, file): ExpectedShard(f"{source}/{file}", "0" * 64, 4)}
    cache = ShardCache(LocalStore(store), tmp_path / "cache", 10 * SHARD_BYTES, victim)
    with pytest.raises(CacheError, match="is not a bare file name"):
        cache.get(source, file)
    after = tree_digest(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("cache")} == before


def test_a_read_waits_for_another_processs_download_no_longer_than_its_deadline(store, tmp_path):
    """Another process of the node holds the shard's download lock (a prefetch waiting out the
    Hub; here a lock of its own on the same file, which flock treats alike): a read with a
    deadline gives up when it is spent, as the store being away, naming the shard; no entry,
    partial or ledger changed, and the read succeeds once the lock is free."""
    from filelock import FileLock

    from ds_trhash.data.stream.deadline import read_deadline
    from ds_trhash.data.stream.store.base import ReadTimedOut, StoreUnavailable

    cache = cache_for(store, tmp_path / "cache", 10 * SHARD_BYTES)
    path = cf.entry_path(cache.root, "a", "shard-00001.bin")
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cf.side(path, cf.LOCK)), is_singleton=False):
        before = _entries(tmp_path / "cache")
        started = time.monotonic()
        with pytest.raises(ReadTimedOut, match=r"cannot get a/shard-00001.bin within data.hub_wait_minutes \(0.5 s\): another process of this node") as e:
            with read_deadline(0.5):
                cache.get("a", "shard-00001.bin")
        assert 0.4 < time.monotonic() - started < 5 and isinstance(e.value, StoreUnavailable)
        assert _entries(tmp_path / "cache") == before  # a hold file beside the entry is all it left
    assert cache.get("a", "shard-00001.bin").read_bytes() == (store / "a" / "shard-00001.bin").read_bytes()
    cache.close()


def _entries(directory):
    return {name: digest for name, digest in tree_digest(directory).items() if not name.endswith(cf.HOLD)}
