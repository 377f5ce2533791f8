"""The node cache's prefetching: the shards a reader names next, fetched ahead and held until read.

A prefetched shard stays held (by the process that fetched it) until its reader takes it into
its working set, or until it leaves what the reader says it needs next: the reader asks for
shards in the order it will first read them, so a prefetch never evicts a shard that is read
before the one it fetches (that one is held already, by a reader or by an earlier prefetch). Each
process holds at most what its share of the bound leaves beside its reader's hold budget (at most
``prefetch`` shards; fetched beyond that, a shard is only marked ready), so the node's readers
and prefetches never hold more than the bound together, and a read that finds no room takes it
back from its own process's prefetches.

Where it runs: in training, a process of its own per rank (``fetcher``; the list goes there and
the answers come back); elsewhere, or when that process cannot run, one thread of this process.
``Prefetching`` is that part of ``cache.ShardCache``, whose constructor sets the state it uses
(the queue, the in-flight set, the ready holds, the prefetch process, the generation).
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Iterable, Optional

from ds_trhash.data.stream import cache_files as cf
from ds_trhash.data.stream.cache_files import CacheError, ShardIntegrityError
from ds_trhash.data.stream.fetcher import Fetcher, FetcherGone

from ds_trhash.data.stream.types import Key


class Prefetching:
    """The prefetch half of ``ShardCache`` (see the module)."""

    def _drop_ready(self, key: Key) -> None:
        """Forget a prefetched shard, releasing its hold if it had one (the caller holds ``_cond``)."""
        hold = self._ready.pop(key)
        if hold is not None:
            hold.release()
        self.generation += 1

    def _give_back_prefetched(self) -> bool:
        """A read that finds no room takes it from this process's prefetched shards, the one read
        last first (a read comes before what is prefetched for later): True when one was let go.
        A prefetch process is told to let go of all of them (once: it does so between fills)."""
        fetcher = self._poll_fetcher()
        if fetcher is not None:
            if not fetcher.sent:
                return False
            try:
                fetcher.want(())
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
            return True
        with self._cond:
            held = [key for key, hold in self._ready.items() if hold is not None]
            if not held:
                return False
            self._drop_ready(held[-1])
        return True

    def prefetch(self, upcoming: Iterable[Key]) -> bool:
        """Queue the first shards of ``upcoming`` (in the order they are first read) for a
        background download, leaving out those this process holds or has prefetched: at most
        ``prefetch`` are queued or kept prefetched at once, and a prefetched shard that left
        ``upcoming`` is let go. It touches no file and wakes the worker only when a shard comes
        into view. True when every shard left was queued (False: more were, ask again)."""
        if self.prefetch_depth == 0:
            return True
        order = list(dict.fromkeys((k[0], k[1]) for k in upcoming))
        if self._closed:
            raise CacheError("prefetch on a closed ShardCache")
        fetcher = self._started_fetcher() and self._poll_fetcher()  # one object: another thread may drop it
        if fetcher is not None:
            try:
                fetcher.want(tuple(key for key in order if key not in self._holding))
                return not order  # asked again whenever this process's holds change
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
        with self._cond:
            if self._closed:
                raise CacheError("prefetch on a closed ShardCache")
            self._let_go(set(order))
            left = [key for key in order if key not in self._holding and key not in self._ready
                    and key not in self._inflight]
            wanted = left[: max(0, self.prefetch_depth - len(self._ready) - len(self._inflight))]
            if wanted != list(self._queue):
                self._queue = deque(wanted)
                if wanted and self._worker is None:
                    self._worker = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
                    self._worker.start()
                self._cond.notify_all()
            return len(left) == len(wanted)

    def _let_go(self, still_wanted: set[Key]) -> None:
        """Release the prefetched shards no longer in view (the caller holds ``_cond``)."""
        for key in [key for key in self._ready if key not in still_wanted]:
            self._drop_ready(key)

    def _raise_worker_error(self) -> None:
        """A prefetch that hit a corrupt shard stops the run at the next read, with its message."""
        if self._error is not None:
            raise self._error

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key = self._queue.popleft()
                self._inflight.add(key)
            try:
                self._prefetch_one(key)
            except ShardIntegrityError as exc:
                self._error = exc
            except (CacheError, OSError):
                self._count("prefetch_errors")  # the read that needs it fetches it and reports
            finally:
                with self._cond:
                    self._inflight.discard(key)
                    self.generation += 1
                    self._cond.notify_all()

    def fetch_ahead(self, key: Key) -> tuple[bool, cf.Hold]:
        """A prefetch's fill: ``key`` fetched (or found verified) without waiting for room, and
        held: (verified in the cache now, the hold, which the caller keeps or releases)."""
        path = cf.entry_path(self.root, *key, self._resolved_root)
        shard = self._expected(key)
        hold = cf.Hold(path)
        try:
            ready = cf.trusted(path, shard.sha256, shard.size)
            if not ready:
                ready = self._ensure(key, path, wait=False)
                if ready:
                    self._count("prefetched")
        except BaseException:
            hold.release()
            raise
        return ready, hold

    def take_counts(self) -> tuple[dict, Optional[tuple[int, int]]]:
        """(this process's counts since the last call, the usage its last scan saw): what a
        prefetch process hands back to its rank after each fill."""
        with self._cond:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts, self._usage_seen

    def _prefetch_one(self, key: Key) -> None:
        """Fetch (or find verified) one queued shard and keep it held for its reader; let go at
        once when the reader took it meanwhile or the cache closed."""
        ready, hold = self.fetch_ahead(key)
        with self._cond:
            keep = ready and key not in self._holding and key not in self._ready and not self._closed
            if keep:
                held = sum(kept is not None for kept in self._ready.values())
                self._ready[key], hold = (hold, None) if held < self._hold_allowance else (None, hold)
        if hold is not None:
            hold.release()

    def _started_fetcher(self) -> Optional[Fetcher]:
        """The prefetch process (``fetcher``), started at the first prefetch; None when prefetches
        run in this process."""
        with self._fetcher_lock:  # two threads reading at once start one process
            if self._fetcher is None and not self._closed:
                recipe = {"store": self.store, "cache_dir": self.cache_dir, "max_bytes": self.max_bytes,
                          "shards": self._shards, "commit": self.commit, "depth": self.prefetch_depth,
                          "allowance": self._hold_allowance}
                try:
                    self._fetcher = Fetcher(recipe)
                except FetcherGone as exc:
                    self._fetcher = False
                    self._say_gone(exc)
        return self._fetcher or None

    def _fetcher_gone(self, fetcher: Fetcher, why: BaseException) -> None:
        """Prefetch here from now on; said once, on stderr (slower reads, the same bytes). Only
        the thread that meets ``fetcher`` gone first drops it (the others met the same end), and
        a cache that closed it says nothing."""
        with self._fetcher_lock:
            if self._fetcher is not fetcher:
                return
            self._fetcher = False
        fetcher.close()
        if not self._closed:
            self._say_gone(why)

    @staticmethod
    def _say_gone(why: BaseException) -> None:
        print(f"note: shard prefetches now run in the reading process: {why}", file=sys.stderr, flush=True)

    def _take_answers(self, answers: list[tuple]) -> None:
        """What the prefetch process did: its counts, and the error of a corrupt shard (raised
        at the next read, as a thread's would be)."""
        for _key, result, counts, usage in answers:
            with self._cond:
                for name, amount in counts.items():
                    self._counts[name] += amount
                self._counts["prefetch_errors"] += isinstance(result, BaseException)
            self._usage_seen = usage or self._usage_seen
            if isinstance(result, ShardIntegrityError):
                self._error = result

    def _poll_fetcher(self) -> Optional[Fetcher]:
        """The prefetch process's answers so far, taken without waiting; the process, if any."""
        fetcher = self._fetcher or None
        if fetcher is not None:
            try:
                self._take_answers(fetcher.answers())
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
                return None
        return fetcher

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no prefetch is queued or downloading (tests and clean shutdown)."""
        fetcher = self._poll_fetcher()
        if fetcher is not None:
            try:
                idle, answers = fetcher.wait_idle(timeout)
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
                return False
            self._take_answers(answers)
            return idle
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._inflight, timeout=timeout)
