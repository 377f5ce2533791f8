"""The node's bounded shard cache: each shard downloaded once per node, verified, held while read.

* ``shard_cache`` - ``ShardCache``: holds, downloads under a lock, eviction within the bound;
* ``prefetch``    - the shards a reader names next, fetched ahead and held until read (the cache
  owns one ``Prefetcher``);
* ``fetcher``, ``fetch_worker`` - those prefetches, run by a process of their own beside the rank;
* ``files``       - the cache directory's files: entries, verified markers, holds, usage, partials;
* ``bound``       - the bound (``data.cache_gb``) and each process's share of it;
* ``place``       - where the cache may live (node-local by default), checked before training.

Imports ``store`` and the stream's shared names (``types``, ``deadline``, ``mapped_shard``).
"""
from ds_trhash.data.stream.cache.bound import CACHE_ENV, GIB, MOST_PREFETCH, cache_bytes_from, prefetch_depth
from ds_trhash.data.stream.cache.files import CacheError, ShardIntegrityError
from ds_trhash.data.stream.cache.place import (CACHE_DIR_ENV, CACHE_MARKER, cache_dir_of, check_cache_place, claim,
                                               default_cache_dir, filesystem_type)
from ds_trhash.data.stream.cache.shard_cache import ExpectedShard, ShardCache

__all__ = ["CACHE_DIR_ENV", "CACHE_ENV", "CACHE_MARKER", "GIB", "MOST_PREFETCH", "CacheError", "ExpectedShard",
           "ShardCache", "ShardIntegrityError", "cache_bytes_from", "cache_dir_of", "check_cache_place", "claim",
           "default_cache_dir", "filesystem_type", "prefetch_depth"]
