"""The cache directory's files: entry names, verified markers, holds, usage, stale partials.

One cache directory serves every rank of a node. For a shard entry ``<root>/<source>/<file>``:

- ``<file>``: complete and verified; it appears only by a rename once its size and SHA-256 matched.
- ``<file>.verified.json``: {sha256, bytes, mtime_ns}, written before that rename; an entry whose
  size and mtime_ns still match is trusted without hashing it again (a later run adopts it).
- ``<file>.partial-<pid>-<thread>``: a download in flight, created at its full size so that the
  bytes it will take are counted from the first moment.
- ``<file>.lock``: held (exclusive) by the one process downloading it; the other ranks wait.
- ``<file>.hold``: locked shared by every reader that holds the entry (for as long as the shard is
  in its working set); eviction needs it exclusive (never blocks), so a shard in use is never
  removed. Its mtime is the entry's last use (LRU order). (``<file>.pin``: the same file as
  earlier versions named it; skipped, so an old cache directory is still read.)

At the top of the cache directory, ``.evict.lock`` (every change to what the bound counts is made
under it) and ``.usage.json``, the ledger: {bytes, entries} as the last change left them. A fill
reads the ledger instead of walking every entry; bytes are added to it before they are written and
taken off after they are deleted, so a process killed in between leaves it counting more than is
there, never less. Its entries count a download in flight as the entry it is becoming (a walk
counts them the same way), so the count does not change when the download is renamed into place.
Where it could count less (it is missing or unreadable, or files were copied in from outside) or
leaves no room, a walk finds the truth and writes it.

The names come from manifests and plans (untrusted input): each part must be a bare file name,
and every path is checked to stay inside the cache directory before anything is created,
replaced or deleted.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from filelock import FileLock, Timeout

from ds_trhash.errors import UserError
from ds_trhash.safe_names import UnsafeNameError, bare_name

MARKER = ".verified.json"
PARTIAL = ".partial-"
LOCK, HOLD = ".lock", ".hold"
OLD_HOLD = ".pin"  # what earlier versions called the hold file
EVICT_LOCK = ".evict.lock"
USAGE = ".usage.json"
# How often a waiter retries a held lock: the default 50 ms made a read that met its shard being
# prefetched (or the eviction lock taken) wait up to 50 ms more than the download took.
LOCK_POLL_S = 0.002
_SIDE = (MARKER, LOCK, HOLD, OLD_HOLD)
_PARTIAL_NAME = re.compile(r"\.partial-\d+-\d+$")  # exactly the partials the cache names (partial_path)


class CacheError(UserError, ValueError):
    """The cache cannot serve a shard (unknown shard, too small a bound, a name that escapes)."""


class ShardIntegrityError(CacheError):
    """A shard's bytes do not match the SHA-256 its manifest recorded (after one re-download)."""


def cache_root(cache_dir: Path, identity: str, commit: str) -> Path:
    """One folder per store and commit inside the node's cache directory (the ``<root>`` above)."""
    return Path(cache_dir) / hashlib.sha256(f"{identity}@{commit}".encode()).hexdigest()[:16]


def entry_path(root: Path, source: str, file: str, resolved_root: Optional[Path] = None) -> Path:
    """``root/source/file`` for bare names only; refuses anything that would land elsewhere
    (``resolved_root``: ``root.resolve()``, when the caller knows it already)."""
    for what, name in (("source", source), ("file", file)):
        try:
            bare_name(name, f"shard {what} name")
        except UnsafeNameError as exc:
            raise CacheError(f"shard {what} name {name!r} is not a bare file name; the plan or manifest naming it "
                             f"is malformed ({exc})") from None
    path = root / source / file
    if not path.resolve().is_relative_to(resolved_root or root.resolve()):
        raise CacheError(f"cache entry {path} would lie outside the cache directory {root}")
    return path


def side(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def read_marker(path: Path) -> Optional[dict]:
    try:
        doc = json.loads(side(path, MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def trusted(path: Path, sha256: str, size: int, st: Optional[os.stat_result] = None) -> bool:
    """The entry is complete and its marker still describes it (no hashing); ``st``: its stat,
    when the caller took it already."""
    try:
        st = st or path.stat()
    except OSError:
        return False
    marker = read_marker(path)
    return (marker is not None and st.st_size == size and marker.get("bytes") == size
            and marker.get("mtime_ns") == st.st_mtime_ns and marker.get("sha256") == sha256)


def write_marker(partial: Path, final: Path, sha256: str, size: int) -> None:
    """The marker of ``final``, describing ``partial``'s bytes (a rename keeps mtime_ns)."""
    doc = {"sha256": sha256, "bytes": size, "mtime_ns": partial.stat().st_mtime_ns}
    tmp = side(final, f"{PARTIAL}{os.getpid()}-marker")  # under the download lock: never stale
    tmp.write_text(json.dumps(doc), encoding="utf-8")
    os.replace(tmp, side(final, MARKER))


class Hold:
    """A shared lock on an entry's hold file (created if needed), taken now and kept until
    ``release``: while any reader holds it, the entry is never evicted. Taking it marks the
    entry's last use."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = os.open(side(path, HOLD), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            os.utime(self._fd)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the lock


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an entry for the block's duration."""
    hold = Hold(path)
    try:
        yield
    finally:
        hold.release()


def try_evict(path: Path) -> bool:
    """Remove an entry no reader holds, and its marker; False when some reader holds it."""
    fd = os.open(side(path, HOLD), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        side(path, MARKER).unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def download_lock(path: Path) -> FileLock:
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(side(path, LOCK)), is_singleton=False, preserve_lock_file=True, poll_interval=LOCK_POLL_S)


def evict_lock(cache_dir: Path) -> FileLock:
    return FileLock(str(cache_dir / EVICT_LOCK), is_singleton=False, preserve_lock_file=True, poll_interval=LOCK_POLL_S)


def read_usage(cache_dir: Path) -> Optional[tuple[int, int]]:
    """(bytes, entries) the ledger holds; None when it is missing or unreadable (walk instead)."""
    try:
        doc = json.loads((cache_dir / USAGE).read_bytes())
        used, entries = doc["bytes"], doc["entries"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if type(used) is not int or type(entries) is not int or used < 0 or entries < 0:
        return None
    return used, entries


def write_usage(cache_dir: Path, used: int, entries: int) -> None:
    """The ledger, under the eviction lock (a write cut short reads as missing: the next fill walks)."""
    (cache_dir / USAGE).write_text(json.dumps({"bytes": max(0, used), "entries": max(0, entries)}), encoding="utf-8")


def is_stale_partial(path: Path) -> bool:
    """A partial whose downloader is gone (its lock is free): a killed run's leftovers."""
    owner = path.with_name(path.name.split(PARTIAL)[0])
    lock = FileLock(str(side(owner, LOCK)), is_singleton=False, preserve_lock_file=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True


def _counted(cache_dir: Path, prune: bool) -> Iterator[tuple[str, int, bool]]:
    """(path, bytes, complete) of every entry and partial download under the cache, as plain
    strings (a walk runs at every download: no path objects per file); stale partials are
    deleted on the way (they count no more) unless ``prune`` is false."""
    for folder, _, names in os.walk(cache_dir):
        present = set(names)  # the folder's files: a marker is looked up here, not stat-ed
        for name in names:
            if name.endswith(_SIDE) or name in (EVICT_LOCK, USAGE) or name.endswith("-marker"):
                continue  # a few hundred bytes of bookkeeping per entry, not counted
            full = os.path.join(folder, name)
            partial = _PARTIAL_NAME.search(name) is not None
            if prune and partial and is_stale_partial(Path(full)):
                Path(full).unlink(missing_ok=True)
                continue
            if not partial and name + MARKER not in present:
                continue  # not written by the cache (no verified marker): never counted, replaced or evicted
            try:
                size = os.stat(full).st_size
            except OSError:
                continue
            yield full, size, not partial


def scan_all(cache_dir: Path, prune: bool = True) -> tuple[int, list[tuple[float, Path]], int]:
    """``scan``, and the number of downloads in flight (the ledger counts them as entries)."""
    used, entries, in_flight = 0, [], 0
    for full, size, complete in _counted(cache_dir, prune):
        used += size
        if not complete:
            in_flight += 1
            continue
        try:
            last = os.stat(full + HOLD).st_mtime
        except OSError:
            last = 0.0
        entries.append((last, Path(full)))
    return used, sorted(entries), in_flight


def scan(cache_dir: Path, prune: bool = True) -> tuple[int, list[tuple[float, Path]]]:
    """(bytes of every entry and partial download under the cache, [(last use, entry)] of complete
    entries, least recently used first); stale partials are deleted on the way (they count no
    more) unless ``prune`` is false: an observer that only measures (it then counts them, and
    takes no download's lock)."""
    return scan_all(cache_dir, prune)[:2]
