"""The cache's prefetching: what a reader will read next is held from its prefetch to its read,
let go once read or out of view, and held only within the process's share of the bound."""
import pytest

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.stream.corpus import open_corpus
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.data.stream.cache.test_shard_cache import KEYS, cache_for, entry_bytes


@pytest.fixture()
def store(tmp_path):
    return write_corpus(tmp_path / "store")


def test_a_prefetched_shard_stays_held_until_read_or_out_of_view(store, tmp_path):
    """What the reader will read next is never evicted between its prefetch and its read: held
    by the prefetching process (at most ``prefetch`` shards), let go once read or no longer in
    view; a read that finds no room takes it back from the shard prefetched for latest."""
    cache = cache_for(store, tmp_path / "cache", 3 * SHARD_BYTES, prefetch=2)
    first, second, third = KEYS[0], KEYS[1], KEYS[2]
    cache.prefetch([first, second, third])
    assert cache.wait_idle()
    path = {key: cf.entry_path(cache.root, *key) for key in KEYS}
    assert not cf.try_evict(path[first]) and not cf.try_evict(path[second])  # held: no one evicts them
    assert not path[third].exists() and cache.counters()["prefetched"] == 2  # two at most
    shard = cache.hold_shard(*first, seq_len=8)  # the reader takes it: its hold now, the prefetch's gone
    cache.prefetch([second, third])
    assert cache.wait_idle() and path[third].exists()
    shard.release()
    assert cf.try_evict(path[first])  # read and released: evictable again
    cache.prefetch([third])  # second left the view: let go
    assert cf.try_evict(path[second]) and not cf.try_evict(path[third])
    with cache.held(*KEYS[3]), cache.held(*KEYS[4]):
        assert path[third].exists()
        with cache.held(*KEYS[5]):  # no room but the prefetched third's: taken back
            assert not path[third].exists() and entry_bytes(tmp_path / "cache") == 3 * SHARD_BYTES
    cache.close()


def test_prefetches_are_held_only_within_the_processes_share_of_the_bound(store, tmp_path):
    """Four readers on a node whose bound leaves each one shard beside its hold budget: each
    keeps one prefetched shard held, and one more is fetched but left evictable, so the node's
    readers and prefetches together never hold more than the bound."""
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 8 * SHARD_BYTES,
                                                                prefetch=2, ranks_on_node=4)
    assert cache.hold_budget == SHARD_BYTES
    cache.prefetch(KEYS[:2])
    assert cache.wait_idle() and cache.counters()["prefetched"] == 2
    first, second = (cf.entry_path(cache.root, *key) for key in KEYS[:2])
    assert not cf.try_evict(first) and cf.try_evict(second)  # the first held, the second only fetched
    cache.close()
    assert cf.try_evict(first)  # closing lets go of it
