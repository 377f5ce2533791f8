"""One running launch per output directory: ``<output_dir>/.run.lock``.

Two launches writing into one output directory corrupt each other's checkpoints and metrics,
and the window is wide: after Ctrl-C the ``deepspeed`` runner returns the prompt while the
ranks still write their stop checkpoint. So rank 0 of every launch takes an exclusive
``fcntl.flock`` on this file before it writes anything and holds it until the process exits;
the kernel releases it when the process ends, however it ends (``kill -9`` included), so a
stale lock never blocks a restart. The file holds who holds it (host, pid, the launch's
rendezvous address, start time) for the refusal message.

The file stays once a launch has run: a launch waiting for the lock holds the same file open,
and had the finishing launch removed it, a third launch could create and lock a new file under
the same name while the second held the old one (two holders). Only a launch refused before it
wrote anything leaves the directory as it found it, removing a lock file it created; that is
safe because ``acquire``, once it holds a lock, checks that the path still names the file it
locked and starts over when it does not.

Everything a launch decides about its output directory (fresh start, which checkpoint to
resume, refusal) is decided while rank 0 holds the lock: the other ranks decide after the
process group started, which waits for rank 0 (docs/stages.md, "One launch per output directory").

The other ranks of a launch do not take the lock; they probe it. A shared lock that cannot be
taken means a launch holds it: when the holder named in the file is this launch (same
rendezvous address and world size, which two live launches cannot share), the probe passes, otherwise the rank refuses too, so a
refused launch fails on every rank at once instead of leaving ranks waiting for a rank 0
that is gone.

The Hub watcher and cleanup probe the same lock to learn whether a run is still alive.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ds_trhash.checkpoints.state import CheckpointError

RUN_LOCK = ".run.lock"
# a peer rank's probe holds a shared lock for microseconds: rank 0 retries this long before it refuses
_SETTLE_S = 2.0
# how long rank 0 waits for a lock another launch holds before it refuses (default _SETTLE_S): a
# relaunch may wait out a stopping run's last checkpoint (docs/stages.md, "One launch per output directory")
WAIT_ENV = "DS_TRHASH_RUN_LOCK_WAIT"


def wait_seconds() -> float:
    """``DS_TRHASH_RUN_LOCK_WAIT`` (seconds, ≥ 0) or the default settle time."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return _SETTLE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise CheckpointError(f"{WAIT_ENV}={raw!r} is not a number of seconds ≥ 0; unset it (wait "
                              f"{_SETTLE_S:g} s) or set e.g. {WAIT_ENV}=60")
    return max(value, _SETTLE_S)


class RunLocked(CheckpointError):
    """Another launch is alive in this output directory."""


def launch_identity() -> str:
    """The same string on every rank of one launch: the rendezvous address the launcher gave
    them (two live launches cannot share it), or this process for a launch without one."""
    addr, port, world = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    if addr and port:
        return f"{addr}:{port}/world {world or 1}"
    return f"{socket.gethostname()}/pid {os.getpid()}"


def read_holder(output_dir: str | os.PathLike) -> dict[str, Any]:
    """What the lock file says about its last holder ({} when absent or unreadable)."""
    try:
        doc = json.loads((Path(output_dir) / RUN_LOCK).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "a launch whose details are not readable"
    return (f"pid {holder.get('pid')} on host {holder.get('host')} (launch {holder.get('launch')}, "
            f"started {holder.get('started')})")


def _try(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False


def _refusal(output_dir: Path) -> RunLocked:
    return RunLocked(
        f"{output_dir} is in use by a running launch: {describe_holder(read_holder(output_dir))}; one launch per "
        "output directory: wait for it to exit (after a stop it is still writing its checkpoint), stop it, or "
        "choose another --output-dir")


class RunLock:
    """The held lock of this process (rank 0); released when the process exits, or by ``release``."""

    def __init__(self, output_dir: Path, fd: int, created_dir: bool, previous: bytes | None):
        self.output_dir, self.fd, self.created_dir, self.previous = output_dir, fd, created_dir, previous
        self.kept = False  # set by ``keep`` once the launch writes into the directory

    def keep(self) -> None:
        """The launch is about to write: from now on the lock file stays, naming this launch."""
        self.kept = True

    def release(self) -> None:
        """Release it. A launch that wrote (``keep``) leaves the lock file with its own record in
        place. A launch refused before writing leaves the directory as it found it: a lock file it
        created is removed (and the directory, when taking the lock created it and it is empty
        again), an earlier one gets its previous content back; so a refused launch changes nothing."""
        if self.fd < 0:
            return
        path = self.output_dir / RUN_LOCK
        try:
            if self.kept:
                pass
            elif self.previous is None:
                path.unlink()
                if self.created_dir and not any(self.output_dir.iterdir()):
                    self.output_dir.rmdir()
            else:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, self.previous, 0)
        except OSError:
            pass  # a read-only or vanished directory: the kernel still frees the lock below
        os.close(self.fd)
        self.fd = -1


def _open(out: Path) -> tuple[int, bool, bool]:
    """(fd of the lock file, whether this created the directory, whether the file existed)."""
    created = not out.exists()
    existed = (out / RUN_LOCK).exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        return os.open(out / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644), created, existed
    except OSError as exc:
        raise CheckpointError(f"cannot write to {out}: {exc.strerror or exc}; choose a writable --output-dir "
                              f"(cannot create the run lock {out / RUN_LOCK})") from None


def _still_named(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (a refused launch may have removed it)."""
    try:
        now, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def acquire(output_dir: str | os.PathLike, log: Callable[[str], None] = lambda _: None) -> RunLock:
    """Rank 0: take the output directory's lock (creating the directory when needed), or raise
    ``RunLocked`` naming the live holder once ``wait_seconds()`` passed. ``log`` is told once
    when the lock is held by another launch and this one waits."""
    out = Path(output_dir)
    wait = wait_seconds()
    deadline = time.monotonic() + wait
    created_any = told = False
    while True:
        fd, created, existed = _open(out)
        created_any = created_any or created
        while not _try(fd, fcntl.LOCK_EX):
            if time.monotonic() >= deadline:
                os.close(fd)
                raise _refusal(out)
            if not told and wait > _SETTLE_S:
                log(f"waiting up to {wait:g} s ({WAIT_ENV}) for the run lock of {out}, held by "
                    f"{describe_holder(read_holder(out))}")
                told = True
            time.sleep(0.05)
        if _still_named(fd, out / RUN_LOCK):
            break
        os.close(fd)  # its holder was refused and removed it: lock the file that is there now
    previous = os.pread(fd, 1 << 16, 0) if existed else None
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(), "launch": launch_identity(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(doc) + "\n").encode(), 0)
    return RunLock(out, fd, created_any, previous)


def check_peer(output_dir: str | os.PathLike) -> None:
    """A rank other than 0: refuse when a launch other than this one holds the lock."""
    out = Path(output_dir)
    path = out / RUN_LOCK
    if not path.exists():
        return  # rank 0 creates it; it cannot be held by anyone yet
    fd = os.open(path, os.O_RDONLY)
    try:
        if _try(fd, fcntl.LOCK_SH):
            return  # free: our rank 0 is about to take it (and refuses for us if it cannot)
        # as long as rank 0 waits for another launch's lock: refusing sooner would end the launch
        deadline = time.monotonic() + wait_seconds()
        while True:  # held: by our rank 0 (its record may still be being written) or by another launch
            if read_holder(out).get("launch") == launch_identity():
                return  # our own rank 0 (on this node or another one: the same rendezvous)
            if time.monotonic() >= deadline:
                raise _refusal(out)
            time.sleep(0.05)
    finally:
        os.close(fd)


def is_alive(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The holder record when a launch holds the lock now, else None (a probe, never blocking)."""
    path = Path(output_dir) / RUN_LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if _try(fd, fcntl.LOCK_SH):
            return None
        return read_holder(output_dir) or {"pid": None}
    finally:
        os.close(fd)
