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
``Prefetcher`` is that part of the node cache: ``cache.ShardCache`` builds one and hands it what
it needs from the cache (its lock, its holds, its fill and its counts), and the prefetcher keeps
its own state (the queue, the in-flight shard, the ready holds, the prefetch process, its part of
the generation).
"""
from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Any, Callable, Iterable, Mapping, Optional

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.stream.cache.files import CacheError, ShardIntegrityError
from ds_trhash.data.stream.cache.fetcher import Fetcher, FetcherGone

from ds_trhash.data.stream.types import Key

Usage = Optional[tuple[int, int]]  # (bytes, entries) of the node's cache as a process last saw it


class Prefetcher:
    """One process's prefetches for one node cache (see the module)."""

    def __init__(self, depth: int, allowance: int, *, lock: threading.Condition, holding: Mapping[Key, int],
                 fill: Callable[[Key], tuple[bool, cf.Hold]], count: Callable[[str, float], None],
                 tally: Callable[[Mapping[str, float], Usage], None], recipe: Optional[dict[str, Any]]) -> None:
        """``depth``: shards queued or kept ready at once; ``allowance``: of those, how many stay
        held (``cache_bound.prefetch_holds``); ``lock``: the cache's, which guards ``holding`` (the
        holds of this process's readers, by shard) and the counts; ``fill``: one shard fetched
        without waiting for room, and held (``ShardCache.fetch_ahead``); ``count``/``tally``: add
        to the cache's counts (``tally``: a prefetch process's counts and the usage it saw);
        ``recipe``: how a prefetch process opens the cache (``fetcher``), None: prefetch here."""
        self.depth, self.allowance = depth, allowance
        self._cond, self._holding, self._fill, self._count, self._tally = lock, holding, fill, count, tally
        self._recipe = recipe
        # the prefetch process (``fetcher``): None until the first prefetch starts it; False when
        # it is not wanted, or could not start or exited (then a thread here prefetches)
        self._fetcher: Optional[Fetcher | bool] = None if recipe is not None else False
        self._fetcher_lock = threading.Lock()  # starting or dropping the process (several threads read)
        self._queue: deque[Key] = deque()
        self._inflight: set[Key] = set()  # the shard the prefetch thread is fetching now
        # shards the prefetch thread verified: held until read or let go (None: verified, not held,
        # when this process's share of the bound leaves no room to hold more)
        self._ready: dict[Key, Optional[cf.Hold]] = {}
        self.thread: Optional[threading.Thread] = None  # the prefetch thread, once one was needed
        self.error: Optional[BaseException] = None  # a corrupt shard met by a prefetch
        self.generation = 0  # this part of ``ShardCache.generation``: a prefetch done or let go
        self.closed = False

    @property
    def pid(self) -> Optional[int]:
        """The prefetch process's pid, None while prefetches run in this process or before the first."""
        return self._fetcher.pid if isinstance(self._fetcher, Fetcher) else None

    def taken(self, key: Key) -> Optional[cf.Hold]:
        """A reader takes ``key``: the prefetch's hold on it, for the caller to release once its
        own hold is taken (the caller holds the lock)."""
        return self._ready.pop(key, None)

    def _drop_ready(self, key: Key) -> None:
        """Forget a prefetched shard, releasing its hold if it had one (the caller holds the lock)."""
        hold = self._ready.pop(key)
        if hold is not None:
            hold.release()
        self.generation += 1

    def give_back(self) -> bool:
        """A read that finds no room takes it from this process's prefetched shards, the one read
        last first (a read comes before what is prefetched for later): True when one was let go.
        A prefetch process is told to let go of all of them (once: it does so between fills)."""
        fetcher = self.poll()
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

    def want(self, upcoming: Iterable[Key]) -> bool:
        """Queue the first shards of ``upcoming`` (in the order they are first read) for a
        background download, leaving out those this process holds or has prefetched: at most
        ``depth`` are queued or kept prefetched at once, and a prefetched shard that left
        ``upcoming`` is let go. It touches no file and wakes the worker only when a shard comes
        into view. True when every shard left was queued (False: more were, ask again)."""
        if self.depth == 0:
            return True
        order = list(dict.fromkeys((k[0], k[1]) for k in upcoming))
        if self.closed:
            raise CacheError("prefetch on a closed ShardCache")
        fetcher = self._started_fetcher() and self.poll()  # one object: another thread may drop it
        if fetcher is not None:
            try:
                fetcher.want(tuple(key for key in order if key not in self._holding))
                return not order  # asked again whenever this process's holds change
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
        with self._cond:
            if self.closed:
                raise CacheError("prefetch on a closed ShardCache")
            self._let_go(set(order))
            left = [key for key in order if key not in self._holding and key not in self._ready
                    and key not in self._inflight]
            wanted = left[: max(0, self.depth - len(self._ready) - len(self._inflight))]
            if wanted != list(self._queue):
                self._queue = deque(wanted)
                if wanted and self.thread is None:
                    self.thread = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
                    self.thread.start()
                self._cond.notify_all()
            return len(left) == len(wanted)

    def _let_go(self, still_wanted: set[Key]) -> None:
        """Release the prefetched shards no longer in view (the caller holds the lock)."""
        for key in [key for key in self._ready if key not in still_wanted]:
            self._drop_ready(key)

    def raise_error(self) -> None:
        """A prefetch that hit a corrupt shard stops the run at the next read, with its message."""
        if self.error is not None:
            raise self.error

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self.closed:
                    self._cond.wait()
                if self.closed:
                    return
                key = self._queue.popleft()
                self._inflight.add(key)
            try:
                self._prefetch_one(key)
            except ShardIntegrityError as exc:
                self.error = exc
            except (CacheError, OSError):
                self._count("prefetch_errors", 1)  # the read that needs it fetches it and reports
            finally:
                with self._cond:
                    self._inflight.discard(key)
                    self.generation += 1
                    self._cond.notify_all()

    def _prefetch_one(self, key: Key) -> None:
        """Fetch (or find verified) one queued shard and keep it held for its reader; let go at
        once when the reader took it meanwhile or the cache closed."""
        ready, filled = self._fill(key)
        hold: Optional[cf.Hold] = filled  # handed to the reader's slot, or let go below
        with self._cond:
            keep = ready and key not in self._holding and key not in self._ready and not self.closed
            if keep:
                held = sum(kept is not None for kept in self._ready.values())
                if held < self.allowance:
                    self._ready[key], hold = hold, None
                else:
                    self._ready[key] = None
        if hold is not None:
            hold.release()

    def _started_fetcher(self) -> Optional[Fetcher]:
        """The prefetch process (``fetcher``), started at the first prefetch; None when prefetches
        run in this process."""
        with self._fetcher_lock:  # two threads reading at once start one process
            if self._fetcher is None and not self.closed:
                try:
                    self._fetcher = Fetcher(self._recipe) if self._recipe is not None else False
                except FetcherGone as exc:
                    self._fetcher = False
                    self._say_gone(exc)
        return self._fetcher if isinstance(self._fetcher, Fetcher) else None

    def _fetcher_gone(self, fetcher: Fetcher, why: BaseException) -> None:
        """Prefetch here from now on; said once, on stderr (slower reads, the same bytes). Only
        the thread that meets ``fetcher`` gone first drops it (the others met the same end), and
        a cache that closed it says nothing."""
        with self._fetcher_lock:
            if self._fetcher is not fetcher:
                return
            self._fetcher = False
        fetcher.close()
        if not self.closed:
            self._say_gone(why)

    @staticmethod
    def _say_gone(why: BaseException) -> None:
        print(f"note: shard prefetches now run in the reading process: {why}", file=sys.stderr, flush=True)

    def _take_answers(self, answers: list[tuple]) -> None:
        """What the prefetch process did: its counts, and the error of a corrupt shard (raised
        at the next read, as a thread's would be)."""
        for _key, result, counts, usage in answers:
            failed = isinstance(result, BaseException)
            self._tally({**counts, "prefetch_errors": counts.get("prefetch_errors", 0) + failed}, usage)
            if isinstance(result, ShardIntegrityError):
                self.error = result

    def poll(self) -> Optional[Fetcher]:
        """The prefetch process's answers so far, taken without waiting; the process, if any."""
        fetcher = self._fetcher if isinstance(self._fetcher, Fetcher) else None
        if fetcher is not None:
            try:
                self._take_answers(fetcher.answers())
            except FetcherGone as exc:
                self._fetcher_gone(fetcher, exc)
                return None
        return fetcher

    def wait_idle(self, timeout: float) -> bool:
        """Block until no prefetch is queued or downloading (tests and clean shutdown)."""
        fetcher = self.poll()
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

    def close(self, join_s: float) -> None:
        """No more prefetches: the queue dropped, the process closed (a fill in flight is cut
        short: its partial is a stale one), the thread joined for ``join_s`` at most (a daemon: one
        still in a download is not waited for long), every prefetched shard let go."""
        with self._cond:
            self.closed = True
            self._queue.clear()
            self._cond.notify_all()
            fetcher = self._fetcher
        if isinstance(fetcher, Fetcher):
            fetcher.close()
        if self.thread is not None:
            self.thread.join(timeout=join_s)
        with self._cond:
            self._let_go(set())
