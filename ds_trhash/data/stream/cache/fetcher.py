"""A rank's prefetches, run by a process of their own beside it.

Why a process: a prefetch thread in the reading process needs the interpreter lock at every turn
of a download (the client's chunks, the cache's locks, markers and bound walk), and on a busy node
each hand-over of that lock waits for the scheduler, and the reads wait with it (figures:
docs/performance.md, "Shard streaming"). So the whole prefetch (which shards,
their fills, the holds that keep them from eviction until they are read) runs in this worker; the
reading thread only writes what it wants next and reads, without blocking, what was done.

The rank's side (``Fetcher``) sends the worker the shards it will read next, in order (less those
it holds itself), whenever that list changes. The worker keeps at most ``depth`` of them ready:
fetched and verified in the node cache (``cache.ShardCache._ensure``, never waiting for room),
each held while its share of the bound allows (``allowance``), and lets go of those that leave the
list (the rank holds them itself once it reads them). After each fill it answers with what it
counted, or the error that stopped the fill; a shard it found verified already counts nothing and
gets no answer. It starts at a lower priority than its rank (its fills can wait; the rank's reads
should not) and sets up its store's client first, so that its first download does not.

The worker (``fetch_worker``) is a fresh interpreter (``python -m ds_trhash.data.stream.cache.fetch_worker
FD``): not a fork of
a rank that runs CUDA, gloo and DeepSpeed threads, and not ``multiprocessing``'s spawn, which
would import the launch script again. It ignores Ctrl-C and SIGTERM (they reach the whole process
group; its rank decides how to stop) and exits when its rank closes the connection or is gone; a
download cut that way leaves a partial file that the next scan deletes.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from ds_trhash.data.stream.cache.files import CacheError
from ds_trhash.data.stream.types import Key

# what the prefetch process ignores: the stop signals a job's whole process group may receive (SIGUSR1:
# a SLURM step's time-limit warning reaches every process of the step; the rank stops, this must not die)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK",
                            "ROLE_RANK", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT"})
_EXIT_WAIT_S = 2.0  # a closing rank waits this long for the worker to finish its fill, then kills it


class FetcherGone(CacheError):
    """The prefetch process could not start, or exited; the cache prefetches in its own process."""


class Fetcher:
    """The rank's side: messages to the worker never block on a fill; answers are read with
    ``poll`` (no thread of the rank waits for the worker).

    One connection, several threads of the rank (the training thread asks for the figures, the
    reading threads name shards): every poll, receive and send holds ``_lock``, so that one
    thread at a time speaks on it (two readers of one pipe split its messages between them and
    read half a message as a whole one). After ``close`` every call raises ``FetcherGone``."""

    def __init__(self, recipe: dict[str, Any]) -> None:
        try:
            payload = pickle.dumps(recipe)
        except Exception as exc:  # a store that cannot travel: the cache prefetches in-process
            raise FetcherGone(f"the shard store cannot be handed to a prefetch process ({exc})") from None
        self._sock, theirs = socket.socketpair()
        self._conn = Connection(os.dup(self._sock.fileno()))  # shutdown on the socket ends a wait on it
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._proc = _start(theirs)
        finally:
            theirs.close()
        self.sent: Optional[tuple[Key, ...]] = None  # the last list sent
        try:  # its start-up (an interpreter, the imports) is not waited for: it answers "ready" later
            self._conn.send_bytes(payload)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _check_open(self) -> None:
        if self._closed:
            raise FetcherGone("the shard prefetch process was closed")

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise FetcherGone(f"the shard prefetch process exited (status {self._proc.poll()}): {exc!r}") from None

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as exc:
            raise FetcherGone(f"the shard prefetch process is gone ({exc!r})") from None

    def want(self, order: tuple[Key, ...]) -> None:
        """The shards to keep ready, in the order they will be read (sent only when it changed)."""
        with self._lock:
            self._check_open()
            if order != self.sent:
                self._send(("want", order))
                self.sent = order

    def answers(self) -> list[tuple]:
        """The fills done since the last call, without waiting: (key, True when verified in the
        cache / False when the bound left no room / the exception that stopped it, counts,
        usage seen)."""
        found = []
        with self._lock:
            self._check_open()
            try:
                while self._conn.poll(0):
                    found.extend(self._fill_answer(self._recv()))
            except OSError as exc:
                raise FetcherGone(f"the shard prefetch process is gone ({exc!r})") from None
        return found

    @staticmethod
    def _fill_answer(reply: tuple) -> list[tuple]:
        if reply[0] == "error":  # the worker could not set up the cache
            raise FetcherGone(f"the shard prefetch process could not start: {reply[1]}")
        return [reply[1:]] if reply[0] == "filled" else []

    def wait_idle(self, timeout: float) -> tuple[bool, list[tuple]]:
        """(the worker had nothing left to fill within ``timeout``, the fills answered meanwhile)."""
        with self._lock:
            self._check_open()
            self._send(("idle?",))
            found: list[tuple] = []
            deadline = time.monotonic() + timeout
            try:
                while self._conn.poll(max(0.0, deadline - time.monotonic())):
                    reply = self._recv()
                    if reply[0] == "idle":
                        return True, found
                    found.extend(self._fill_answer(reply))
            except OSError as exc:
                raise FetcherGone(f"the shard prefetch process is gone ({exc!r})") from None
        return False, found

    def close(self) -> None:
        """Shut the connection (the worker exits after the fill in flight; its holds go with it);
        kill it if that takes long. Safe twice, and from any thread: the shutdown ends another
        thread's wait on the connection before the connection is closed under its lock."""
        self._closed = True
        with contextlib.suppress(OSError):  # shut already, or the worker's end is gone: nothing to wake
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._sock.close()
            self._conn.close()
        proc = getattr(self, "_proc", None)
        if proc is None:
            return
        try:
            proc.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(theirs: socket.socket) -> subprocess.Popen:
    """The worker, started with Ctrl-C and SIGTERM blocked (the mask survives exec, so a signal
    sent to the group during its start-up never reaches it: it ignores them before unblocking).
    It is not a rank: the variables that make a process one are left out of its environment, so
    what finds a job's ranks by them (``ops.jobs.ranks``, which signals them) passes it by."""
    package_parent = str(Path(__file__).resolve().parents[3])
    env = {name: value for name, value in os.environ.items() if name not in RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return subprocess.Popen([sys.executable, "-m", "ds_trhash.data.stream.cache.fetch_worker", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
