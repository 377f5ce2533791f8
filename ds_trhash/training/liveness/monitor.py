"""The liveness thread of one rank: heartbeats out, heartbeats in, verdicts acted on.

Once per ``interval_s`` the thread reads the beacon the training thread writes (``phases``),
sends one datagram to every peer, collects what arrived meanwhile and asks the ``Watch`` for a
verdict. The training thread never waits for it: its whole cost there is the beacon's attribute
writes (docs/performance.md, "Liveness").

On time while the training thread computes: the thread sleeps in ``select``, which releases the
interpreter lock; CPython makes a running thread hand the lock over every switch interval (5 ms),
and torch releases it inside its operators and collectives, so the thread runs within
milliseconds of its timeout. A stretch of pure-Python work that keeps the lock for seconds only
delays one heartbeat among the ``silent_s / interval_s`` (30) that must be missed, and the watcher
discounts any gap in its own running (``Watch.tick``) instead of blaming the peers for it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ds_trhash.training.liveness.channel import Channel, PeerInfo
from ds_trhash.training.liveness.exit import describe, end_process, say, write_record
from ds_trhash.training.liveness.phases import Beacon, Limits
from ds_trhash.training.liveness.verdict import ABORTED, Verdict, Watch

NOTICE_REPEATS = 3  # an abort, a verdict or a goodbye goes out this many times (UDP may drop one)


class Liveness:
    """One rank's liveness: ``start`` the thread, ``close(code)`` at the end of the launch.

    ``act(verdict)`` is what a verdict does (default: the line, ``lost_peer.json``, the hard exit;
    the tests pass their own); ``clock`` the monotonic clock."""

    def __init__(self, channel: Channel, me: PeerInfo, peers: list[PeerInfo], limits: Limits, *,
                 output_dir: str | Path | None = None, world: int | None = None, launch: str = "",
                 clock: Callable[[], float] = time.monotonic, act: Callable[[Verdict], Any] | None = None):
        self.channel, self.me, self.limits, self.clock = channel, me, limits, clock
        self.channel.peers = list(peers)
        self.world = world if world is not None else len(peers) + 1
        self.output_dir, self.launch = output_dir, launch
        self.beacon = Beacon()
        self.watch = Watch(me, list(peers), limits, clock())
        self.act = act or self._end
        self.verdict: Verdict | None = None
        self._lock, self._once = threading.Lock(), threading.Lock()
        self._decided, self._acted, self._departed = threading.Event(), threading.Event(), threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> "Liveness":
        with self._lock:
            self.watch.restart(self.clock())
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._closed.is_set() and self.verdict is None:
            self.beat()

    def close(self, code: int = 0) -> None:
        """The launch ends with ``code``: the thread stops and the peers are told (a goodbye, so
        that its silence is never taken for a loss); nothing is sent after a verdict."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self.channel.wake()
            self._thread.join(2 * self.limits.interval_s + 1.0)
        if self.verdict is None:
            for _ in range(NOTICE_REPEATS):
                self.channel.send({"k": "bye", "r": self.me.rank, "c": int(code)})
        self.channel.close()

    # ----------------------------------------------------------------- one interval

    def beat(self, wait: float | None = None) -> Verdict | None:
        """Send this rank's heartbeat, take in what arrives within ``wait`` (default: the interval)
        and judge: the thread's loop body (the tests call it with their own clock)."""
        b = self.beacon
        step, mark, phase = b.step, b.mark, b.phase
        with self._lock:
            age = self.watch.own(self.clock(), step, mark, phase)
        self.channel.send({"k": "hb", "r": self.me.rank, "s": step, "m": mark, "p": phase, "a": round(age, 3)})
        for message in self.channel.receive(self.limits.interval_s if wait is None else wait, until=self._closed):
            self._take(message)
        with self._lock:
            verdict = self.watch.tick(self.clock())
        if verdict is not None:
            self._decide(verdict)
        return self.verdict

    def _take(self, m: dict[str, Any]) -> None:
        kind, rank = m.get("k"), m["r"]
        try:
            if kind == "hb":
                with self._lock:
                    self.watch.heard(self.clock(), rank, int(m["s"]), int(m["m"]), str(m["p"]), float(m["a"]))
            elif kind == "bye":
                with self._lock:
                    self.watch.left(rank, int(m["c"]))
                if int(m["c"]) != 0:
                    self._departed.set()
            elif kind == "abort":
                with self._lock:
                    verdict = self.watch.aborted(rank, str(m["why"]), int(m["c"]))
                self._decide(verdict)
            elif kind == "lost":
                self._decide(self._adopted(m["v"]))
        except (KeyError, TypeError, ValueError):  # a malformed datagram of this launch: ignored
            pass

    def _adopted(self, fields: dict[str, Any]) -> Verdict:
        """Another rank's verdict, taken as this rank's own (the same rank named everywhere)."""
        verdict = Verdict(**{**fields, "itself": fields["rank"] == self.me.rank})
        with self._lock:
            self.watch.verdict = self.watch.verdict or verdict
            return self.watch.verdict

    # ----------------------------------------------------------------- verdicts

    def _decide(self, verdict: Verdict) -> None:
        if not self._once.acquire(blocking=False):
            return
        self.verdict = verdict
        self._decided.set()
        if verdict.reason != ABORTED and not verdict.itself:  # the others adopt it at once
            for _ in range(NOTICE_REPEATS):
                self.channel.send({"k": "lost", "r": self.me.rank, "v": verdict.__dict__})
        try:
            self.act(verdict)
        finally:
            self._acted.set()

    def _end(self, verdict: Verdict) -> None:
        line = describe(verdict, self.me.rank, self.world)
        say(line)
        if self.output_dir is not None and not (verdict.reason == ABORTED and verdict.rank != self.me.rank):
            try:
                write_record(Path(self.output_dir), verdict, self.launch, line)
            except OSError:  # the disk may be what failed: the line is said, the exit code too
                pass
        end_process(verdict.code)

    def abort(self, reason: str, code: int) -> None:
        """Every rank ends with ``code``: a notice to every peer (repeated), this rank's own line,
        and the hard exit (from any thread). Peers print a line naming this rank and ``reason``."""
        for _ in range(NOTICE_REPEATS):
            self.channel.send({"k": "abort", "r": self.me.rank, "why": reason, "c": int(code)})
        with self._lock:
            verdict = self.watch.aborted(self.me.rank, reason, code)
        self._decide(verdict)
        self._acted.wait()

    def publish_refusal(self) -> str | None:
        """Why a checkpoint must not be published now, or None (``checkpoints``' publish guard)."""
        with self._lock:
            return self.watch.unhealthy(self.clock())

    def wait_for_verdict(self, timeout: float | None = None) -> Verdict | None:
        """After a collective failed: the verdict, once acted on (normally the process has ended
        by then), or None when a peer left with its own failure or ``timeout`` (default: the
        silence limit and a few heartbeats, by when a lost peer is named) passed first."""
        if timeout is None:
            timeout = self.limits.silent_s + 5 * self.limits.interval_s + 5.0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._departed.is_set():
            if self._decided.wait(0.1):
                self._acted.wait()
                return self.verdict
        return None
