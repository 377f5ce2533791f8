"""The verdicts: which rank is lost, from what has been heard and when (a pure state machine,
driven by the clock its caller passes in, so the rules are tested without waiting).

- **silent**: a peer unheard for ``silent_s``. When every peer on every other node is silent and
  there are at least two other nodes, this rank is the one cut off, and it names itself.
- **own starvation**: the watcher itself did not run for a gap (its process was stopped, the
  machine hung). That gap is not the peers' silence: a gap shorter than ``silent_s`` is forgiven
  (their last-heard times move forward by it); a longer one means the others have given up on
  this rank, which then names itself (it was frozen or cut off) and must not go on alone.
- **stuck**: the rank with the lowest position ``(step, mark)`` (``phases``) has held that
  position, with some rank ahead of it all along, longer than the limit of its phase.
- **aborted**: a peer broadcast an abort (``Liveness.abort``), with its reason and exit code.

A peer that said goodbye (its launch ended, with its own message) is never judged again, and
once one left with a failure no verdict is given: that rank's own error is the story, and the
launcher or the collectives end the rest as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ds_trhash.training.liveness.channel import PeerInfo
from ds_trhash.training.liveness.phases import STARTUP, Limits
from ds_trhash.training.signals import EXIT_PEER_LOST

SILENT, STUCK, ABORTED = "silent", "stuck", "aborted"


@dataclass(frozen=True)
class Verdict:
    """A lost (or aborting) rank, as every rank that can still run reports it."""

    rank: int
    node: int
    host: str
    step: int
    phase: str
    silent_s: float  # unheard (silent), at its position (stuck), or 0 (aborted)
    reason: str  # SILENT | STUCK | ABORTED
    detected_by_rank: int
    code: int = EXIT_PEER_LOST
    itself: bool = False  # this rank names itself: it was frozen or cut off
    detail: str = ""  # an abort's reason; a stuck rank's limit; how many more ranks are silent


@dataclass
class Seen:
    """What this rank knows of one rank (itself included)."""

    info: PeerInfo
    heard_at: float
    step: int = 0
    mark: int = -1
    phase: str = STARTUP
    age: float = 0.0  # seconds at its position when last heard, by its own clock
    left: int | None = None  # the exit code it said goodbye with


@dataclass
class Watch:
    """One rank's view of all ranks; ``tick`` once per interval, ``heard`` per heartbeat."""

    me: PeerInfo
    peers: list[PeerInfo]
    limits: Limits
    now: float
    seen: dict[int, Seen] = field(init=False)
    last_tick: float = field(init=False)
    since: float = field(init=False)  # when this rank's own position last changed
    verdict: Verdict | None = None
    # the laggard (rank, position) some rank is ahead of, and since when this rank has seen that
    lagging: tuple[int, tuple[int, int]] | None = None
    lagging_since: float = 0.0

    def __post_init__(self) -> None:
        self.seen = {p.rank: Seen(p, self.now) for p in [self.me, *self.peers]}
        self.restart(self.now)

    def restart(self, now: float) -> None:
        """The watch begins now (its thread starts): the time before is nobody's silence."""
        self.last_tick = self.since = now
        for peer in self.seen.values():
            peer.heard_at = max(peer.heard_at, now)

    # ----------------------------------------------------------------- what comes in

    def own(self, now: float, step: int, mark: int, phase: str) -> float:
        """This rank's beacon as read now; returns the age of its position."""
        mine = self.seen[self.me.rank]
        if (step, mark, phase) != (mine.step, mine.mark, mine.phase):
            mine.step, mine.mark, mine.phase, self.since = step, mark, phase, now
        mine.heard_at, mine.age = now, now - self.since
        return mine.age

    def heard(self, now: float, rank: int, step: int, mark: int, phase: str, age: float) -> None:
        peer = self.seen.get(rank)
        if peer is not None and rank != self.me.rank and peer.left is None:
            peer.heard_at, peer.step, peer.mark, peer.phase, peer.age = now, step, mark, phase, age

    def left(self, rank: int, code: int) -> None:
        if rank in self.seen and rank != self.me.rank:
            self.seen[rank].left = code

    def aborted(self, rank: int, reason: str, code: int) -> Verdict:
        peer = self.seen[rank] if rank in self.seen else Seen(PeerInfo(rank, -1, "?", "", 0), self.now)
        self.verdict = self.verdict or Verdict(rank, peer.info.node, peer.info.host, peer.step, peer.phase, 0.0,
                                               ABORTED, self.me.rank, code=code, detail=reason)
        return self.verdict

    # ----------------------------------------------------------------- judging

    def tick(self, now: float) -> Verdict | None:
        """Once per interval: this rank's own starvation first, then the peers."""
        gap, self.last_tick = now - self.last_tick, now
        if self.verdict is None and gap > self.limits.silent_s:
            mine = self.seen[self.me.rank]
            self.verdict = Verdict(self.me.rank, self.me.node, self.me.host, mine.step, mine.phase, gap, SILENT,
                                   self.me.rank, itself=True)
        elif gap > 2 * self.limits.interval_s:  # the watcher did not run: not the peers' silence
            for peer in self.seen.values():
                peer.heard_at = min(now, peer.heard_at + gap - self.limits.interval_s)
        if self.verdict is None:
            self.verdict = self.judge(now)
        return self.verdict

    def judge(self, now: float) -> Verdict | None:
        others = [p for r, p in self.seen.items() if r != self.me.rank]
        if any(p.left not in (None, 0) for p in others):
            return None
        active = [p for p in others if p.left is None]
        silent = [p for p in active if now - p.heard_at > self.limits.silent_s]
        if silent:
            return self._silent(now, active, silent)
        return self._stuck(now, [self.seen[self.me.rank], *active])

    def _silent(self, now: float, active: list[Seen], silent: list[Seen]) -> Verdict:
        remote = [p for p in active if p.info.node != self.me.node]
        nodes = {p.info.node for p in remote}
        mine = self.seen[self.me.rank]
        if len(nodes) >= 2 and all(p in silent for p in remote):  # nobody elsewhere hears this node
            return Verdict(self.me.rank, self.me.node, self.me.host, mine.step, mine.phase,
                           min(now - p.heard_at for p in silent), SILENT, self.me.rank, itself=True,
                           detail=f"no rank of the {len(nodes)} other nodes was heard")
        first = silent[0]
        more = f"{len(silent) - 1} more rank(s) silent too" if len(silent) > 1 else ""
        return Verdict(first.info.rank, first.info.node, first.info.host, first.step, first.phase,
                       now - first.heard_at, SILENT, self.me.rank, detail=more)

    def _stuck(self, now: float, ranks: list[Seen]) -> Verdict | None:
        def position(p: Seen) -> tuple[int, int]:
            return (p.step, p.mark)

        laggard = min(ranks, key=lambda p: (position(p), p.info.rank))
        if not any(position(p) > position(laggard) for p in ranks):
            self.lagging = None
            return None
        if self.lagging != (laggard.info.rank, position(laggard)):  # a new laggard (or a stale heartbeat's)
            self.lagging, self.lagging_since = (laggard.info.rank, position(laggard)), now
        # at its position this long, and others ahead of it that long: a rank that waited long in
        # step with the others and is overtaken first (a heartbeat late) is not stuck
        age = min(laggard.age + (now - laggard.heard_at), now - self.lagging_since)
        limit = self.limits.of(laggard.phase)
        if age <= limit:
            return None
        return Verdict(laggard.info.rank, laggard.info.node, laggard.info.host, laggard.step, laggard.phase, age,
                       STUCK, self.me.rank, itself=laggard.info.rank == self.me.rank, detail=f"limit {limit:.0f} s")

    def unhealthy(self, now: float) -> str | None:
        """Why a checkpoint must not be published now (None: it may): a verdict, a peer unheard
        for the silence limit, or this rank's own watcher stopped that long (it was frozen)."""
        if self.verdict is not None:
            return f"rank {self.verdict.rank} was lost ({self.verdict.reason})"
        gap = now - self.last_tick
        if gap > self.limits.silent_s:
            return f"this rank did not run for {gap:.0f} s (frozen or cut off)"
        forgiven = gap - self.limits.interval_s if gap > 2 * self.limits.interval_s else 0.0  # as tick will
        for r, p in self.seen.items():
            silent = now - p.heard_at - forgiven
            if r != self.me.rank and p.left is None and silent > self.limits.silent_s:
                return f"rank {r} has not been heard for {silent:.0f} s"
        return None
