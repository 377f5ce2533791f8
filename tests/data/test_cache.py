import numpy as np
import pytest

from ds_trhash.data.cache import GIB, CacheError, ShardCache, ShardIntegrityError, cache_bytes_from
from ds_trhash.data.shards import load_manifests, write_shards

SHARD_BYTES = (4 * 8 + 1) * 2  # 4 rows of 8 tokens + 1, uint16


@pytest.fixture()
def store(tmp_path):
    """Two sources of 6 full shards each (the stream length is an exact multiple)."""
    for offset, source in ((1, "a"), (500, "b")):
        stream = np.arange(offset, offset + 6 * 32 + 1)
        write_shards(source, [stream], 8, 4, tmp_path / "store", vocab_size=1000, tokenizer_hash="h")
    return tmp_path / "store"


def disk_bytes(directory):
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_get_copies_verifies_and_then_hits(store, tmp_path):
    cache = ShardCache(store, tmp_path / "cache", 10 * SHARD_BYTES, manifests=load_manifests([store]))
    path = cache.get("a", "shard-00002.bin")
    assert path.read_bytes() == (store / "a" / "shard-00002.bin").read_bytes()
    assert path.parent.parent == tmp_path / "cache"
    assert cache.get("a", "shard-00002.bin") == path
    assert cache.stats() == {"bytes": SHARD_BYTES, "files": 1, "max_bytes": 10 * SHARD_BYTES, "hits": 1,
                             "misses": 1, "evictions": 0, "prefetched": 0, "prefetch_errors": 0}
    with pytest.raises(CacheError, match="not in that source's manifest"):
        cache.get("a", "shard-00099.bin")
    cache.close()


def test_bound_is_never_exceeded_and_released_shards_go_first(store, tmp_path):
    limit = int(2.5 * SHARD_BYTES)
    cache = ShardCache(store, tmp_path / "cache", limit)  # manifests read from the store on demand
    order = [("a", f"shard-{i:05d}.bin") for i in range(6)] + [("b", f"shard-{i:05d}.bin") for i in range(6)]
    for source, file in order:
        cache.get(source, file)
        assert disk_bytes(tmp_path / "cache") <= limit
        assert cache.stats()["bytes"] <= limit
    assert cache.stats()["evictions"] == 10 and cache.stats()["files"] == 2
    # With a and b cached, releasing b means b is evicted before the older but unreleased a.
    cache.get("a", "shard-00000.bin")
    cache.get("b", "shard-00000.bin")
    cache.release("b", "shard-00000.bin")
    cache.get("a", "shard-00001.bin")
    names = {(p.parent.name, p.name) for p in (tmp_path / "cache").rglob("*.bin")}
    assert ("a", "shard-00000.bin") in names and ("b", "shard-00000.bin") not in names
    assert disk_bytes(tmp_path / "cache") <= limit
    cache.close()


def test_shard_larger_than_the_cache_is_a_clear_error(store, tmp_path):
    cache = ShardCache(store, tmp_path / "cache", SHARD_BYTES - 1)
    with pytest.raises(CacheError, match="larger than the whole cache"):
        cache.get("a", "shard-00000.bin")


def test_corrupt_shard_is_refused_and_never_cached(store, tmp_path):
    shard = store / "a" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    cache = ShardCache(store, tmp_path / "cache", 10 * SHARD_BYTES)
    for _ in range(2):
        with pytest.raises(ShardIntegrityError, match="shard-00001.bin has sha256"):
            cache.get("a", "shard-00001.bin")
        assert not list((tmp_path / "cache").rglob("shard-00001*"))
    assert cache.stats()["bytes"] == 0
    cache.prefetch([("a", "shard-00001.bin")])
    assert cache.wait_idle()
    assert cache.stats()["prefetch_errors"] == 1 and not list((tmp_path / "cache").rglob("shard-00001*"))
    cache.close()


def test_prefetch_fills_ahead_without_evicting_unreleased(store, tmp_path):
    cache = ShardCache(store, tmp_path / "cache", 3 * SHARD_BYTES, prefetch=2)
    cache.get("a", "shard-00000.bin")
    cache.prefetch([("a", f"shard-{i:05d}.bin") for i in range(1, 5)])
    assert cache.wait_idle()
    assert cache.stats()["prefetched"] == 2 and cache.stats()["files"] == 3
    cache.get("a", "shard-00001.bin")
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1
    # The cache is full of unreleased shards: a prefetch must not evict them ...
    cache.prefetch([("a", "shard-00003.bin")])
    assert cache.wait_idle()
    assert cache.stats()["evictions"] == 0 and cache.stats()["prefetched"] == 2
    # ... but it may take the room of a released one.
    cache.release("a", "shard-00000.bin")
    cache.prefetch([("a", "shard-00003.bin")])
    assert cache.wait_idle()
    assert cache.stats()["evictions"] == 1 and (tmp_path / "cache" / "a" / "shard-00003.bin").exists()
    assert disk_bytes(tmp_path / "cache") <= 3 * SHARD_BYTES
    cache.close()


def test_restart_adopts_cached_copies_and_rechecks_them(store, tmp_path):
    first = ShardCache(store, tmp_path / "cache", 10 * SHARD_BYTES)
    first.get("a", "shard-00000.bin")
    local = first.get("b", "shard-00000.bin")
    first.close()
    data = bytearray(local.read_bytes())
    data[4] ^= 0x01  # same size, damaged local copy
    local.write_bytes(bytes(data))
    (tmp_path / "cache" / "a" / "shard-00005.bin.partial-1-2").write_bytes(b"junk")
    second = ShardCache(store, tmp_path / "cache", 10 * SHARD_BYTES)
    assert second.stats()["files"] == 2 and not list((tmp_path / "cache").rglob("*.partial-*"))
    second.get("a", "shard-00000.bin")
    assert second.stats()["hits"] == 1
    assert second.get("b", "shard-00000.bin").read_bytes() == (store / "b" / "shard-00000.bin").read_bytes()
    assert second.stats()["misses"] == 1
    second.close()


def test_cache_dir_must_differ_from_the_store(store):
    with pytest.raises(CacheError, match="shard store itself"):
        ShardCache(store, store, 10 * SHARD_BYTES)


def test_cache_size_from_env_or_config():
    assert cache_bytes_from(None, {}) == GIB
    assert cache_bytes_from(2.5, {}) == int(2.5 * GIB)
    assert cache_bytes_from(2.5, {"TOKENIZED_CACHE_GB": "0.5"}) == GIB // 2
    assert cache_bytes_from(2.5, {"TOKENIZED_CACHE_GB": ""}) == int(2.5 * GIB)
    with pytest.raises(CacheError, match="TOKENIZED_CACHE_GB='lots' is not a number"):
        cache_bytes_from(1.0, {"TOKENIZED_CACHE_GB": "lots"})
    with pytest.raises(CacheError, match="data.cache_gb=0 must be a positive"):
        cache_bytes_from(0, {})


def test_a_bound_that_rounds_to_zero_bytes_names_its_origin():
    with pytest.raises(CacheError, match=r"data.cache_gb=1e-12 is 1e-12 GiB, which rounds to 0 bytes"):
        cache_bytes_from(1e-12, {})
    with pytest.raises(CacheError, match=r"TOKENIZED_CACHE_GB='1e-12' is 1e-12 GiB, which rounds to 0 bytes"):
        cache_bytes_from(1.0, {"TOKENIZED_CACHE_GB": "1e-12"})
