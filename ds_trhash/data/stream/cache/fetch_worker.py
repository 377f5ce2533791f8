"""The prefetch process's side of ``fetcher`` (see there): the cache's recipe once, then the lists
of shards its rank wants next; one fill at a time, an answer after each that changed a count."""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from ds_trhash.data.stream.cache import files as cf
from ds_trhash.data.stream.cache.shard_cache import ShardCache
from ds_trhash.data.stream.cache.files import CacheError
from ds_trhash.data.stream.cache.fetcher import STOP_SIGNALS
from ds_trhash.data.stream.types import Key

_PARENT_POLL_S = 0.5
# Below the rank: a fill can wait for the CPU, the rank's step and reads should not (on a machine
# with few cores, the fills' hashing and copying slowed the reads beside them).
_NICENESS = 10


def _sendable(exc: BaseException) -> BaseException:
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return CacheError(f"{type(exc).__name__}: {exc}")


class _Worker:
    """Keeps the first ``depth`` shards of the latest list ready, one fill at a time; reads the
    rank's messages between fills."""

    def __init__(self, conn: Connection, cache: ShardCache, depth: int, allowance: int) -> None:
        self.conn, self.cache, self.depth, self.allowance = conn, cache, depth, allowance
        self.order: tuple[Key, ...] = ()
        self.ready: dict[Key, Optional[cf.Hold]] = {}  # verified; held while the allowance lasts
        self.tried: set[Key] = set()  # failed or found no room since the list last changed
        self.asked_idle = False
        self.told_usage: Optional[tuple[int, int]] = None  # the cache usage the last answer carried

    def handle(self, message: tuple) -> None:
        """A new list lets go of the ready shards it no longer names (the rank holds them now, or
        the plan moved on) and gives failed ones another try; "idle?" is answered once nothing
        is left to fill (tests, and a rank that waits for its prefetches)."""
        if message[0] == "want":
            self.order = tuple(message[1])
            for key in [key for key in self.ready if key not in self.order]:
                hold = self.ready.pop(key)
                if hold is not None:
                    hold.release()
            self.tried.clear()
        elif message[0] == "idle?":
            if self.next_key() is None:
                self.conn.send(("idle",))
            else:
                self.asked_idle = True

    def next_key(self) -> Optional[Key]:
        """The first shard of the list not ready and not failed, while fewer than ``depth`` are ready."""
        if len(self.ready) >= self.depth:
            return None
        return next((key for key in self.order if key not in self.ready and key not in self.tried), None)

    def fill(self, key: Key) -> None:
        """One shard fetched and kept held (while the allowance lasts), and the answer sent: the
        rank's counts, and the error for the rank to raise at its next read. A shard found
        verified already changes no count: no answer (each answer costs the reading rank a read at
        its next poll; docs/performance.md, "Shard streaming")."""
        hold: Optional[cf.Hold] = None
        result: bool | BaseException
        try:
            result, hold = self.cache.fetch_ahead(key)
        except Exception as exc:
            result = _sendable(exc)
        if result is True:
            held = sum(kept is not None for kept in self.ready.values())
            self.ready[key], hold = (hold, None) if held < self.allowance else (None, hold)
        else:
            self.tried.add(key)
        if hold is not None:
            hold.release()
        counts, usage = self.cache.take_counts()
        if result is True and not any(counts.values()) and usage == self.told_usage:
            return  # found verified in the cache: nothing the rank lacks (a warm pass sends nothing)
        self.told_usage = usage
        self.conn.send(("filled", key, result, counts, usage))

    def run(self) -> None:
        """Messages first (a changed list may drop the next fill), then the next fill, else wait."""
        while True:
            key = self.next_key()
            if key is None and self.asked_idle:
                self.conn.send(("idle",))
                self.asked_idle = False
            if key is None or self.conn.poll(0):
                try:
                    self.handle(self.conn.recv())
                except (EOFError, OSError):
                    return
                continue
            self.fill(key)


def _watch_parent(parent: int) -> None:
    """Exit as soon as the rank is gone, even in the middle of a download."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_S)
    os._exit(0)


def serve(conn: Connection) -> None:
    """Set up, say so, then fill. A rank that closes the connection at any point (a launch
    refused or failed right after its stream started, while this process was still importing)
    ends it quietly: there is nobody left to tell, and its stderr is the launch's console."""
    try:
        recipe = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # shut before the recipe arrived
    try:
        cache = ShardCache(recipe["store"], recipe["cache_dir"], recipe["max_bytes"], recipe["shards"],
                           commit=recipe["commit"], prefetch=0)
        cache.store.warm_up()
    except Exception as exc:
        with contextlib.suppress(OSError):  # the rank may have shut the connection already
            conn.send(("error", _sendable(exc)))
        return
    try:
        conn.send(("ready",))
        _Worker(conn, cache, recipe["depth"], recipe["allowance"]).run()
    except OSError:
        return  # the rank shut the connection while an answer (or "ready") was on its way


def main(argv: list[str]) -> None:
    os.nice(_NICENESS)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
