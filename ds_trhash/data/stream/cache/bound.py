"""How much the node's shard cache may hold, and each process's share of it.

The bound comes from ``data.cache_gb`` (``TOKENIZED_CACHE_GB`` overrides it). The node's ranks
split it: each reader holds at most its share less room for the prefetches it queues (never less
than one largest shard), and keeps held only the prefetched shards that what is left of its
share has room for, so the node's readers and prefetches never hold more than the bound together.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional

from ds_trhash.data.stream.cache.files import CacheError

GIB = 1024**3
DEFAULT_CACHE_GB = 1.0
CACHE_ENV = "TOKENIZED_CACHE_GB"


def cache_bytes_from(cfg_value: Optional[float], env: Optional[Mapping[str, str]] = None) -> int:
    """Cache bound in bytes (GiB units): TOKENIZED_CACHE_GB overrides the config's cache_gb."""
    env = os.environ if env is None else env
    raw = env.get(CACHE_ENV, "")
    origin = f"{CACHE_ENV}={raw!r}"
    if raw.strip():
        try:
            value = float(raw)
        except ValueError:
            raise CacheError(f"{origin} is not a number of GiB") from None
    else:
        value, origin = (DEFAULT_CACHE_GB if cfg_value is None else float(cfg_value)), f"data.cache_gb={cfg_value!r}"
    if not math.isfinite(value) or value <= 0:
        raise CacheError(f"{origin} must be a positive number of GiB")
    if int(value * GIB) < 1:
        raise CacheError(f"{origin} is {value!r} GiB, which rounds to 0 bytes; give the cache at least a shard "
                         "(data.cache_gb is in GiB: 0.1 is about 107 MB)")
    return int(value * GIB)


def hold_budget(max_bytes: int, ranks_on_node: int, prefetch_depth: int, largest: int) -> int:
    """The bytes one reader may hold at once: its share of the bound, less room for the
    prefetches it queues (a reader that held its whole share would leave them none), and never
    less than one largest shard (the launch refuses a bound below one per rank)."""
    return max(largest, max_bytes // ranks_on_node - prefetch_depth * largest)


def prefetch_holds(max_bytes: int, ranks_on_node: int, prefetch_depth: int, largest: int) -> int:
    """How many prefetched shards one process may keep held: what its share of the bound leaves
    beside its reader's hold budget, at most the prefetch depth; so a read always finds room."""
    if largest == 0:
        return prefetch_depth
    budget = hold_budget(max_bytes, ranks_on_node, prefetch_depth, largest)
    return max(0, min(prefetch_depth, (max_bytes // ranks_on_node - budget) // largest))


MOST_PREFETCH = 8  # shards one process fetches ahead at most, however large the bound


def prefetch_depth(max_bytes: int, ranks_on_node: int, largest: int, least: int, reading: int) -> int:
    """How many shards one process fetches ahead: ``least`` (the room the launch's smallest bound
    keeps for it), and more, up to ``MOST_PREFETCH``, when its share of the bound holds more than
    twice the ``reading`` shards its reader has open at once: a bound with room to spare then
    buys time ahead of the reader (the plan names the shards of the next minutes) at no cost."""
    if largest <= 0:
        return least
    spare = max_bytes // max(1, ranks_on_node) // largest - 2 * reading
    return max(least, min(MOST_PREFETCH, spare))
