"""The cache's bound: from the config or the environment (a value that rounds to nothing names its
origin), and how far ahead a process prefetches: the launch's smallest bound keeps the least,
room to spare buys more, never past the most, and the node's ranks share the bound."""
import pytest

from ds_trhash.data.stream.cache.bound import GIB, MOST_PREFETCH, cache_bytes_from, hold_budget, prefetch_depth
from ds_trhash.data.stream.cache import CacheError
from ds_trhash.data.stream.corpus import PREFETCH_SHARDS, open_corpus
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus

SHARD = 1000


def test_the_smallest_bound_keeps_the_least_and_room_to_spare_buys_more():
    two_sources = (2 + PREFETCH_SHARDS) * SHARD  # what the launch accepts at least, for one rank
    assert prefetch_depth(two_sources, 1, SHARD, PREFETCH_SHARDS, 2) == PREFETCH_SHARDS
    assert prefetch_depth(10 * SHARD, 1, SHARD, PREFETCH_SHARDS, 2) == 6  # 10 shards, 4 kept for the reader
    assert prefetch_depth(2**40, 1, SHARD, PREFETCH_SHARDS, 2) == MOST_PREFETCH
    assert prefetch_depth(10 * SHARD, 2, SHARD, PREFETCH_SHARDS, 2) == PREFETCH_SHARDS  # 5 shards each
    assert prefetch_depth(SHARD, 1, 0, PREFETCH_SHARDS, 2) == PREFETCH_SHARDS  # no shard sizes known


def test_the_reader_keeps_room_for_the_shards_it_reads_at_once():
    for bound in range(4 * SHARD, 40 * SHARD, SHARD):
        depth = prefetch_depth(bound, 1, SHARD, PREFETCH_SHARDS, 2)
        assert hold_budget(bound, 1, depth, SHARD) >= min(4, bound // SHARD - PREFETCH_SHARDS) * SHARD


def test_a_cache_opened_without_a_depth_takes_it_from_its_bound(tmp_path):
    root = write_corpus(tmp_path / "store")
    corpus = open_corpus(plan_for(root), str(root))
    with corpus.open_cache(tmp_path / "small", 4 * SHARD_BYTES) as small, \
            corpus.open_cache(tmp_path / "large", 100 * SHARD_BYTES) as large, \
            corpus.open_cache(tmp_path / "asked", 100 * SHARD_BYTES, prefetch=1) as asked:
        assert (small.prefetch_depth, large.prefetch_depth, asked.prefetch_depth) == (2, MOST_PREFETCH, 1)


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
