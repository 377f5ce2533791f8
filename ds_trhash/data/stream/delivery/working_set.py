"""A reader's working set: the shards it reads now and in its next few micro-batches.

A shard enters the set once: its names are checked and its path resolved, it is verified and
held in the node cache (or found in the shard directory), and its tokens are memory-mapped, one
map per shard. From then on its rows are cut from memory, so reading a micro-batch makes no
file-system call; the shard leaves the set (its hold released, its map closed) once the reader's
last few micro-batches have not read it and its next ones do not need it, or when the rank's
share of the cache is full.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Collection, Optional

from ds_trhash.data.stream.mapped_shard import MappedShard
from ds_trhash.data.stream.types import Key


class WorkingSet:
    """The open shards of one reader, in order of last use. ``budget``: the bytes this reader may
    hold at once (its share of the node cache); opening a shard beyond it first releases the
    least recently used ones, so the ranks of a node together never hold more than the cache."""

    def __init__(self, opener: Callable[[Key], MappedShard], budget: Optional[int] = None,
                 size_of: Optional[Callable[[Key], int]] = None) -> None:
        self._opener, self._budget, self._size_of = opener, budget, size_of
        self._open: OrderedDict[Key, MappedShard] = OrderedDict()
        self._last_read: dict[Key, int] = {}  # the read (``tick``) that last used each open shard
        self.tick = 0
        self.open_s = 0.0  # seconds spent bringing shards in (checks, holds, waiting for downloads)
        self.opened = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._open

    def get(self, key: Key) -> MappedShard:
        shard = self._open.get(key)
        if shard is None:
            started = time.perf_counter()
            if self._budget is not None and self._size_of is not None:
                self._make_room(self._size_of(key))
            try:
                shard = self._opener(key)
            finally:
                self.open_s += time.perf_counter() - started
            self._open[key] = shard
            self.opened += 1
        else:
            self._open.move_to_end(key)
        self._last_read[key] = self.tick
        return shard

    def _make_room(self, size: int) -> None:
        held = sum(shard.size for shard in self._open.values())
        while self._open and self._budget is not None and held + size > self._budget:
            key, oldest = self._open.popitem(last=False)
            del self._last_read[key]
            held -= oldest.size
            oldest.release()

    def next_read(self, recent: int, upcoming: Collection[Key] = ()) -> None:
        """One read done: release the shards none of the last ``recent`` reads used and
        ``upcoming`` (the next reads' shards, when known) does not name."""
        self.tick += 1
        if self.tick % 4:  # looked at every fourth read: a shard may stay up to three reads longer
            return
        oldest = self.tick - recent
        for key in [key for key, last in self._last_read.items() if last < oldest and key not in upcoming]:
            del self._last_read[key]
            self._open.pop(key).release()

    def close(self) -> None:
        for shard in self._open.values():
            shard.release()
        self._open.clear()
        self._last_read.clear()
