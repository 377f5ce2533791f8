"""One bounded cache of token shards per node, filled from a shard store (local or remote).

Every rank of a node opens the same ``cache_dir``. While a shard is cached the node downloads
it once: the rank that needs it first takes its download lock, the others wait on that lock and
then find the verified file. A download lands under a temporary name created at its full size
(so the bound counts it from the start) and is renamed into place only after its size and
SHA-256 match the manifest; a corrupt download is deleted and fetched once more, then the run
stops naming the shard and both hashes. Nothing unverified is ever returned, and a process
killed mid-download leaves only a partial file, which the next scan deletes.

The bound covers every entry and partial download under ``cache_dir`` (the few hundred bytes of
markers, holds and locks beside each are not counted). To make room, the least recently used
entries that no rank holds are evicted under one eviction lock; a reader holds the shards of its
working set (a shared lock each, taken once per shard, ``working_set``), never more bytes at once
than its share of the bound (the bound over the node's ranks, less room for its prefetches, at
least one shard), so the smallest bound that always works is one largest shard per rank of the
node. A prefetch only ever uses room it can make without waiting, so it never blocks a read.

Prefetching (the shards a reader names next, fetched ahead and held until read) is the job of
the cache's ``prefetch.Prefetcher``: built here, handed the lock, the holds, the counts and
the fill that never waits for room (``fetch_ahead``).

A fill reads the node's usage from a ledger kept under the eviction lock and walks the directory
only when the ledger leaves no room (or is missing), and once as the cache opens: a walk per fill
cost as much as the rest of the fill's bookkeeping, and grew with the entries. The file layout,
the ledger and the locks are in ``files``.

Figures: ``counters()`` is this process's counts and the usage it last saw (no lock, no walk:
cheap enough for every step); ``stats()`` walks the directory under the eviction lock, for the
rare caller (tests, a stage's end).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, Optional

from ds_trhash.io import sha256_file

if TYPE_CHECKING:
    from filelock import AcquireReturnProxy

from filelock import Timeout

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.stream import deadline as read_deadline
from ds_trhash.data.stream.store import ReadTimedOut, ShardStore
from ds_trhash.data.stream.cache.bound import CACHE_ENV, hold_budget, prefetch_holds
from ds_trhash.data.stream.cache.files import CacheError, ShardIntegrityError
from ds_trhash.data.stream.cache.prefetch import Prefetcher, Usage
from ds_trhash.data.stream.mapped_shard import MappedShard
from ds_trhash.data.stream.types import Key

ROOM_WAIT_S = 600.0  # how long a read waits for other ranks to free room before it fails
CLOSE_JOIN_S = 5.0  # how long close waits for the prefetch thread (well inside the launcher's 30 s grace)

__all__ = ["CacheError", "ShardIntegrityError", "ShardCache", "ExpectedShard"]


@dataclass(frozen=True)
class ExpectedShard:
    """What the plan's manifest promises of one shard; the cache checks the bytes it fetches against it
    (``formats.manifest.Shard`` is the manifest's own entry, rows and tokens included)."""
    path: str  # in the store
    sha256: str
    size: int


class ShardCache:
    def __init__(self, store: ShardStore, cache_dir: os.PathLike | str, max_bytes: int, shards: Mapping[Key, ExpectedShard],
                 commit: str = "local", prefetch: int = 2, ranks_on_node: int = 1,
                 fetch_process: bool = False) -> None:
        if max_bytes < 1:
            raise CacheError(f"cache max_bytes must be positive, got {max_bytes}")
        self.store, self.max_bytes, self.prefetch_depth = store, int(max_bytes), max(0, int(prefetch))
        ranks, largest = max(1, int(ranks_on_node)), max((shard.size for shard in shards.values()), default=0)
        self.hold_budget = hold_budget(self.max_bytes, ranks, self.prefetch_depth, largest)
        allowance = prefetch_holds(self.max_bytes, ranks, self.prefetch_depth, largest)
        self.cache_dir = Path(cache_dir)
        self.root = cf.cache_root(self.cache_dir, store.identity, commit)
        self._shards, self.commit = dict(shards), commit
        self._cond = threading.Condition()  # guards the counts and the holds (the prefetcher's state too)
        self._generation = 0  # the reads' part of ``generation``: a shard held or released
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "prefetched": 0, "prefetch_errors": 0,
                        "redownloads": 0, "waited_s": 0.0, "downloaded_bytes": 0}
        self._closed = False
        self._seen: dict[Key, int] = {}  # entries this process found trusted: their mtime_ns then
        self._usage_seen: Usage = None  # (bytes, entries) as this process last saw them
        self._holding: dict[Key, int] = {}  # holds this process has on each entry now
        recipe = None if not fetch_process else {  # how a prefetch process opens this cache (``fetcher``)
            "store": store, "cache_dir": self.cache_dir, "max_bytes": self.max_bytes, "shards": self._shards,
            "commit": commit, "depth": self.prefetch_depth, "allowance": allowance}
        self._prefetcher = Prefetcher(self.prefetch_depth, allowance, lock=self._cond,
                                      holding=self._holding, fill=self.fetch_ahead, count=self._count,
                                      tally=self._tally, recipe=recipe)
        self.root.mkdir(parents=True, exist_ok=True)
        self._resolved_root = self.root.resolve()
        self._evict_lock = cf.evict_lock(self.cache_dir)  # one object: a new one per fill cost more than the lock
        self.usage()  # the ledger made true once (entries may have been copied in since it was written)

    # -- bookkeeping -------------------------------------------------------------------
    def _expected(self, key: Key) -> ExpectedShard:
        shard = self._shards.get(key)
        if shard is None:
            raise CacheError(f"shard {key[0]}/{key[1]} is not in that source's manifest; the plan and the shards disagree")
        if shard.size > self.max_bytes:
            raise CacheError(f"shard {key[0]}/{key[1]} is {shard.size} bytes, larger than the whole cache "
                             f"({self.max_bytes}); raise data.cache_gb or {CACHE_ENV}")
        return shard

    def expected_size(self, key: Key) -> int:
        return self._expected(key).size

    def _count(self, name: str, amount: float = 1) -> None:
        with self._cond:
            self._counts[name] += amount

    def _tally(self, counts: Mapping[str, float], usage: Usage) -> None:
        """A prefetch process's counts since its last answer, and the usage it saw then."""
        with self._cond:
            for name, amount in counts.items():
                self._counts[name] += amount
        self._usage_seen = usage or self._usage_seen

    @property
    def generation(self) -> int:
        """Changes whenever what a prefetch would queue may have (a shard held or released, a prefetch
        done or let go): a reader told "not all queued" asks again only then, not every micro-batch."""
        return self._generation + self._prefetcher.generation

    def _reserve(self, path: Path, size: int, wait: bool) -> Optional[Path]:
        """A partial file of ``size`` bytes, once the bound allows it (LRU eviction of entries no
        reader holds); None for a prefetch that finds no room now."""
        deadline = time.monotonic() + read_deadline.capped(ROOM_WAIT_S)  # within the read's own deadline
        while True:
            with self._evict_lock:
                used, files = self._make_room(path, size)
                if used + size <= self.max_bytes:
                    cf.write_usage(self.cache_dir, used + size, files + 1)  # counted, as an entry, before it exists
                    partial = cf.side(path, f"{cf.PARTIAL}{os.getpid()}-{threading.get_ident()}")
                    with open(partial, "wb") as f:
                        f.truncate(size)
                    return partial
            if not wait:
                return None
            if self._prefetcher.give_back():
                continue
            if self._closed:
                raise CacheError(f"the shard cache {self.cache_dir} was closed while {path.name} waited for room")
            if time.monotonic() > deadline:
                raise CacheError(f"no room for {path.name} in the cache {self.cache_dir} ({self.max_bytes} bytes) "
                                 f"after {ROOM_WAIT_S:.0f} s: other ranks hold it; raise data.cache_gb or {CACHE_ENV}")
            time.sleep(0.05)

    def _make_room(self, path: Path, size: int) -> tuple[int, int]:
        """(bytes, entries) of the node's cache once room for ``size`` more was made if it can be,
        under the eviction lock: the ledger's when it leaves room, else a walk's, evicting the
        least recently used entries no reader holds (``path`` itself never)."""
        known = cf.read_usage(self.cache_dir)
        if known is not None and known[0] + size <= self.max_bytes:
            self._usage_seen = known
            return known
        used, entries, in_flight = cf.scan_all(self.cache_dir)  # the truth, and the LRU order
        files = len(entries) + in_flight
        for _, victim in entries:
            if used + size <= self.max_bytes:
                break
            victim_size = victim.stat().st_size if victim.exists() else 0
            if victim != path and cf.try_evict(victim):
                used, files = used - victim_size, files - 1
                self._count("evictions")
        cf.write_usage(self.cache_dir, used, files)
        self._usage_seen = (used, files)
        return used, files

    def _note_usage(self, added: int, entries: int) -> None:
        """A change to what the bound counts, in the ledger (the caller holds the eviction lock);
        a missing ledger stays missing (the next fill walks)."""
        known = cf.read_usage(self.cache_dir)
        if known is not None:
            self._usage_seen = (known[0] + added, known[1] + entries)
            cf.write_usage(self.cache_dir, *self._usage_seen)

    def _fill(self, key: Key, path: Path, shard: ExpectedShard, wait: bool) -> bool:
        """Download and verify ``key`` into ``path``; the caller holds its download lock and the entry."""
        seen = []
        for attempt in range(2):
            partial = self._reserve(path, shard.size, wait)
            if partial is None:
                return False
            placed = False
            try:
                streamed = self.store.download(shard.path, partial, shard.size)  # hashed as it was written
                size = partial.stat().st_size
                digest = (streamed or sha256_file(partial)) if size == shard.size else f"<{size} bytes, not {shard.size}>"
                if digest == shard.sha256:
                    cf.write_marker(partial, path, shard.sha256, shard.size)
                    with self._evict_lock:  # scans under the lock see it once, never twice
                        os.replace(partial, path)  # counted since its room was made: no ledger change
                        placed = True
                    self._count("downloaded_bytes", shard.size)
                    return True
            finally:
                if not placed:
                    with self._evict_lock:
                        partial.unlink(missing_ok=True)
                        self._note_usage(-shard.size, -1)  # taken off once it is gone
            seen.append(digest)
            self._count("redownloads", attempt == 0)
        raise ShardIntegrityError(
            f"shard {key[0]}/{key[1]} from {self.store.description}: two downloads hashed {seen[0]} and {seen[1]}, "
            f"its manifest records sha256 {shard.sha256}; the store's copy is corrupt (or the manifest is): "
            "restore it, or re-tokenize and re-plan")

    @staticmethod
    def _download_lock(key: Key, path: Path) -> AcquireReturnProxy:
        """The entry's download lock, taken: waited for no longer than what is left of this
        thread's read (``deadline``), else ``ReadTimedOut`` (another process of the node holds
        it: a prefetch waiting out the store, or a rank's read)."""
        left = read_deadline.remaining()
        try:
            return cf.download_lock(path).acquire(timeout=-1 if left is None else left)
        except Timeout:
            raise ReadTimedOut(f"cannot get {key[0]}/{key[1]} within data.hub_wait_minutes ({read_deadline.budget():g} "
                               "s): another process of this node (its prefetch, or another rank) was still downloading "
                               "it; its waits for the store are said above") from None

    def _ensure(self, key: Key, path: Path, wait: bool) -> bool:
        """The entry ``path`` (checked by ``entry_path``) is present and verified (fetched now if
        needed); the caller holds it. Seconds spent waiting count only for a read (``wait``), not
        for the prefetcher."""
        shard = self._expected(key)
        if cf.trusted(path, shard.sha256, shard.size):
            return True
        started = time.monotonic()
        with self._download_lock(key, path):  # one download per node; the others wait here
            if cf.trusted(path, shard.sha256, shard.size):
                self._count("waited_s", (time.monotonic() - started) if wait else 0.0)
                return True
            for stale in path.parent.glob(f"{path.name}{cf.PARTIAL}*"):  # we hold its lock: a dead run's
                stale.unlink(missing_ok=True)
            if path.exists():  # complete but no matching marker (copied in, or touched): hash once
                if path.stat().st_size == shard.size and sha256_file(path) == shard.sha256:
                    with self._evict_lock:  # counted from now on: in the ledger first
                        self._note_usage(shard.size, 1)
                        cf.write_marker(path, path, shard.sha256, shard.size)
                    return True
                cf.side(path, cf.MARKER).unlink(missing_ok=True)
                path.unlink()
            done = self._fill(key, path, shard, wait)
        if done and wait:
            self._count("misses")
            self._count("waited_s", time.monotonic() - started)
        return done

    # -- public API --------------------------------------------------------------------
    def _acquire(self, source: str, file: str) -> tuple[Callable[[], None], Path]:
        """A verified local copy of ``source/file`` (fetched now if needed) and the release of the
        hold that keeps it from eviction until then. The names are checked (and the path
        resolved) here."""
        self._prefetcher.poll()
        self._prefetcher.raise_error()
        key = (source, file)
        path = cf.entry_path(self.root, source, file, self._resolved_root)
        hold = cf.Hold(path)
        with self._cond:
            self._holding[key] = self._holding.get(key, 0) + 1
            prefetched = self._prefetcher.taken(key)
            self._generation += 1
        if prefetched is not None:
            prefetched.release()  # the reader's own hold (taken above) keeps it from here on

        def release() -> None:
            hold.release()
            with self._cond:
                self._holding[key] -= 1
                if not self._holding[key]:
                    del self._holding[key]
                self._generation += 1

        try:
            shard = self._expected(key)
            try:
                st: Optional[os.stat_result] = path.stat()
            except OSError:
                st = None
            if st is not None and self._seen.get(key) == st.st_mtime_ns:  # verified here before, unchanged since
                self._count("hits")
            elif st is not None and cf.trusted(path, shard.sha256, shard.size, st):
                self._count("hits")
            else:
                self._ensure(key, path, wait=True)
                st = None
            self._seen[key] = (st or path.stat()).st_mtime_ns
        except BaseException:
            release()
            raise
        return release, path

    @contextlib.contextmanager
    def held(self, source: str, file: str) -> Iterator[Path]:
        """A verified local copy of ``source/file``, held (never evicted) inside the block."""
        release, path = self._acquire(source, file)
        try:
            yield path
        finally:
            release()

    def hold_shard(self, source: str, file: str, seq_len: int) -> MappedShard:
        """The verified entry, held and memory-mapped until the returned shard is released: how a
        reader's working set takes a shard in (the entry is opened here, inside the cache)."""
        release, path = self._acquire(source, file)
        try:
            return MappedShard((source, file), path, seq_len, on_release=release)
        except BaseException:
            release()
            raise

    def get(self, source: str, file: str) -> Path:
        """Path of a verified copy (fetched now if not cached); no longer held once this returns."""
        with self.held(source, file) as path:
            return path

    @property
    def prefetch_pid(self) -> Optional[int]:
        """The prefetch process's pid (the benchmark reads its CPU time), or None (``Prefetcher.pid``)."""
        return self._prefetcher.pid

    def usage(self) -> int:
        """Bytes of entries and partial downloads now, walked under the eviction lock (one
        consistent view), and written to the ledger."""
        with self._evict_lock:
            used, entries, in_flight = cf.scan_all(self.cache_dir)
            self._usage_seen = (used, len(entries) + in_flight)
            cf.write_usage(self.cache_dir, *self._usage_seen)
        return used

    def counters(self) -> dict:
        """This process's counts, and the node's usage as this process last saw it (a walk, or the
        ledger at its last fill): no lock taken, nothing walked."""
        self._prefetcher.poll()
        used, files = self._usage_seen or (None, None)
        with self._cond:
            return {"bytes": used, "files": files, "max_bytes": self.max_bytes, **self._counts}

    def stats(self) -> dict:
        """``counters()`` with the usage walked now, under the eviction lock: for rare callers."""
        self.usage()
        return self.counters()

    # -- prefetching (``prefetch.Prefetcher``) -------------------------------------
    def prefetch(self, upcoming: Iterable[Key]) -> bool:
        """Fetch ahead the first of ``upcoming`` (``Prefetcher.want``): False when not all were queued."""
        return self._prefetcher.want(upcoming)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no prefetch is queued or downloading (tests and clean shutdown)."""
        return self._prefetcher.wait_idle(timeout)

    def fetch_ahead(self, key: Key) -> tuple[bool, cf.Hold]:
        """A prefetch's fill: ``key`` fetched (or found verified) without waiting for room, and
        held: (verified in the cache now, the hold, which the caller keeps or releases)."""
        path = cf.entry_path(self.root, *key, self._resolved_root)
        shard = self._expected(key)
        hold = cf.Hold(path)
        try:
            ready = cf.trusted(path, shard.sha256, shard.size)
            if not ready and self._ensure(key, path, wait=False):
                ready = True
                self._count("prefetched")
        except BaseException:
            hold.release()
            raise
        return ready, hold

    def take_counts(self) -> tuple[dict, Usage]:
        """(this process's counts since the last call, the usage last seen): a prefetch process's answer."""
        with self._cond:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts, self._usage_seen

    def close(self) -> None:
        """No more reads or prefetches: the prefetcher closed (its process, its thread, its holds)."""
        self._closed = True  # a read waiting for room gives up
        self._prefetcher.close(CLOSE_JOIN_S)

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
