"""Bounded local cache of token shards, filled from a (possibly slow) source store.

Every copied shard is checked against its manifest SHA-256 before it can be returned, so a
corrupt store fails the run instead of training on damaged tokens. The byte bound counts
copies in flight, so the cache directory never holds more than ``max_bytes``.

Eviction order: shards the reader released (least recently used first); a ``get`` that
still lacks room then evicts unreleased shards too, because only the shard being fetched
is needed right now (readers copy rows out of a shard before asking for the next). A
prefetch never evicts unreleased shards: it only uses room that is free or released.

One ShardCache owns its ``cache_dir``: give each rank its own directory.
"""
from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ds_trhash.errors import UserError
from ds_trhash.io import sha256_file

from .shards import MANIFEST_FILE, load_manifest
from .tokenizer import PathLike

GIB = 1024**3
DEFAULT_CACHE_GB = 1.0
CACHE_ENV = "TOKENIZED_CACHE_GB"
_PARTIAL = ".partial-"
_CHUNK = 1 << 20

Key = tuple[str, str]


class CacheError(UserError, ValueError):
    """The cache cannot serve a shard (unknown shard, missing source file, too small a bound)."""


class ShardIntegrityError(CacheError):
    """A shard's bytes do not match the SHA-256 its manifest recorded."""


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


@dataclass
class _Entry:
    size: int
    released: bool
    verified: bool
    last_used: int


class ShardCache:
    def __init__(
        self,
        source_dir: PathLike,
        cache_dir: PathLike,
        max_bytes: int,
        manifests: Optional[Mapping[str, Mapping]] = None,
        prefetch: int = 2,
    ) -> None:
        self.source_dir = Path(source_dir)
        self.cache_dir = Path(cache_dir)
        if self.source_dir.resolve() == self.cache_dir.resolve():
            raise CacheError(f"cache_dir {self.cache_dir} is the shard store itself; use a separate directory")
        if max_bytes < 1:
            raise CacheError(f"cache max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.prefetch_depth = max(0, int(prefetch))
        self._manifests: dict[str, Mapping] = dict(manifests or {})
        self._cond = threading.Condition()
        self._entries: dict[Key, _Entry] = {}
        self._in_flight: dict[Key, int] = {}
        self._queue: deque[Key] = deque()
        self._clock = 0
        self._counts = {"hits": 0, "misses": 0, "evictions": 0, "prefetched": 0, "prefetch_errors": 0}
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._adopt_existing()

    # -- bookkeeping -------------------------------------------------------------------
    def _expected(self, key: Key) -> tuple[str, int]:
        source, file = key
        if source not in self._manifests:
            self._manifests[source] = load_manifest(self.source_dir / source / MANIFEST_FILE)
        for shard in self._manifests[source]["shards"]:
            if shard["file"] == file:
                return shard["sha256"], int(shard.get("bytes", int(shard["tokens"]) * 2))
        raise CacheError(f"shard {source}/{file} is not in that source's manifest; the plan and the shards disagree")

    def _path(self, key: Key) -> Path:
        return self.cache_dir / key[0] / key[1]

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _used(self) -> int:
        return sum(entry.size for entry in self._entries.values()) + sum(self._in_flight.values())

    def _adopt_existing(self) -> None:
        """Keep complete shards from an earlier run (verified on first use); drop partial copies."""
        for path in sorted(self.cache_dir.glob("*/*")):
            if _PARTIAL in path.name:
                path.unlink(missing_ok=True)
                continue
            key = (path.parent.name, path.name)
            try:
                _, size = self._expected(key)
            except (CacheError, ValueError):
                continue
            if path.stat().st_size == size:
                self._entries[key] = _Entry(size, released=True, verified=False, last_used=self._tick())
            else:
                path.unlink()
        with self._cond:
            self._evict_until(0, allow_unreleased=True)

    def _evict_until(self, needed: int, allow_unreleased: bool) -> bool:
        """Evict (LRU, released first) until ``needed`` more bytes fit; caller holds the lock."""
        while self._used() + needed > self.max_bytes:
            candidates = [(not e.released, e.last_used, k) for k, e in self._entries.items()
                          if e.released or allow_unreleased]
            if not candidates:
                return False
            _, _, victim = min(candidates)
            del self._entries[victim]
            self._path(victim).unlink(missing_ok=True)
            self._counts["evictions"] += 1
        return True

    # -- copying -----------------------------------------------------------------------
    def _copy_verified(self, key: Key, sha256: str) -> None:
        """Copy one shard into the cache while hashing it; only a matching copy is kept."""
        source_path = self.source_dir / key[0] / key[1]
        final = self._path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.with_name(f"{final.name}{_PARTIAL}{os.getpid()}-{threading.get_ident()}")
        digest = hashlib.sha256()
        try:
            with open(source_path, "rb") as src, open(partial, "wb") as dst:
                for block in iter(lambda: src.read(_CHUNK), b""):
                    digest.update(block)
                    dst.write(block)
        except FileNotFoundError:
            partial.unlink(missing_ok=True)
            raise CacheError(f"shard {source_path} is missing from the shard store") from None
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if digest.hexdigest() != sha256:
            partial.unlink(missing_ok=True)
            raise ShardIntegrityError(
                f"shard {source_path} has sha256 {digest.hexdigest()}, its manifest records {sha256}; "
                "the stored copy is corrupt: restore or re-tokenize that source"
            )
        os.replace(partial, final)

    def _local_copy_ok(self, key: Key, sha256: str) -> bool:
        return sha256_file(self._path(key), _CHUNK) == sha256

    def _fetch(self, key: Key, sha256: str, size: int, prefetched: bool) -> None:
        """Copy a reserved key in, then record it; the reservation is dropped either way."""
        try:
            self._copy_verified(key, sha256)
        except BaseException:
            with self._cond:
                del self._in_flight[key]
                self._counts["prefetch_errors"] += int(prefetched)  # the get that needs it retries
                self._cond.notify_all()
            raise
        with self._cond:
            del self._in_flight[key]
            self._entries[key] = _Entry(size, released=False, verified=True, last_used=self._tick())
            self._counts["prefetched"] += int(prefetched)
            self._cond.notify_all()

    # -- public API --------------------------------------------------------------------
    def get(self, source: str, file: str) -> Path:
        """Local path of a verified copy of ``source/file``; fetched now if not cached."""
        key = (source, file)
        sha256, size = self._expected(key)
        if size > self.max_bytes:
            raise CacheError(
                f"shard {source}/{file} is {size} bytes, larger than the whole cache ({self.max_bytes}); "
                f"raise data.cache_gb or {CACHE_ENV}"
            )
        with self._cond:
            while True:
                while key in self._in_flight:
                    self._cond.wait()
                entry = self._entries.get(key)
                if entry is not None:
                    if not entry.verified and not self._local_copy_ok(key, sha256):
                        del self._entries[key]
                        self._path(key).unlink(missing_ok=True)
                        continue
                    entry.verified, entry.released, entry.last_used = True, False, self._tick()
                    self._counts["hits"] += 1
                    return self._path(key)
                if self._evict_until(size, allow_unreleased=True):
                    break
                self._cond.wait()  # only copies in flight hold the room; wait for one to land
            self._counts["misses"] += 1
            self._in_flight[key] = size
        self._fetch(key, sha256, size, prefetched=False)
        return self._path(key)

    def release(self, source: str, file: str) -> None:
        """Mark a shard consumed: it stays cached but may be evicted first."""
        with self._cond:
            entry = self._entries.get((source, file))
            if entry is not None:
                entry.released = True

    def prefetch(self, upcoming: Iterable[tuple[str, str]]) -> None:
        """Queue the next few shards (``prefetch`` of them) for a background copy."""
        if self.prefetch_depth == 0:
            return
        with self._cond:
            if self._closed:
                raise CacheError("prefetch on a closed ShardCache")
            wanted: list[Key] = []
            for key in upcoming:
                key = (key[0], key[1])
                if key in wanted or key in self._in_flight:
                    continue
                if key in self._entries:
                    self._entries[key].released = False  # needed again soon: do not evict it first
                    continue
                wanted.append(key)
                if len(wanted) == self.prefetch_depth:
                    break
            self._queue = deque(wanted)
            if self._worker is None:
                self._worker = threading.Thread(target=self._prefetch_loop, name="shard-prefetch", daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def _prefetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key = self._queue.popleft()
                self._cond.notify_all()  # wait_idle may be watching the queue drain
                if key in self._entries or key in self._in_flight:
                    continue
                try:
                    sha256, size = self._expected(key)
                except (CacheError, ValueError):
                    self._counts["prefetch_errors"] += 1
                    continue
                if size > self.max_bytes or not self._evict_until(size, allow_unreleased=False):
                    continue  # no free room: the later get fetches it on demand
                self._in_flight[key] = size
            try:
                self._fetch(key, sha256, size, prefetched=True)
            except (CacheError, OSError):
                continue

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no prefetch is queued or copying (tests and clean shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout=timeout)

    def stats(self) -> dict:
        with self._cond:
            return {
                "bytes": self._used(),
                "files": len(self._entries),
                "max_bytes": self.max_bytes,
                **self._counts,
            }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=30)

    def __enter__(self) -> "ShardCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
