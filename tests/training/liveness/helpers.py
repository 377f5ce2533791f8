"""Liveness endpoints in one process: real UDP sockets on 127.0.0.1, a clock the test moves."""
from __future__ import annotations

from ds_trhash.training.liveness.channel import Channel, PeerInfo
from ds_trhash.training.liveness.monitor import Liveness
from ds_trhash.training.liveness.phases import CHECKPOINT, STARTUP, Limits

LIMITS = Limits(interval_s=1.0, silent_s=30.0, stuck_s=300.0, by_phase={STARTUP: 1800.0, CHECKPOINT: 1800.0})


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def endpoints(n: int, clock: Clock, limits: Limits = LIMITS, nodes: list[int] | None = None,
              output_dir=None) -> tuple[list[Liveness], list[list]]:
    """``n`` ranks' liveness (their threads not started) and what each one's verdicts were."""
    channels = [Channel("127.0.0.1", token="test") for _ in range(n)]
    infos = [PeerInfo(r, (nodes or list(range(n)))[r], f"host{r}", "127.0.0.1", c.port) for r, c in enumerate(channels)]
    acted: list[list] = [[] for _ in range(n)]
    lives = [Liveness(c, infos[r], [p for p in infos if p.rank != r], limits, clock=clock, act=acted[r].append,
                      output_dir=output_dir, launch="launch-1")
             for r, c in enumerate(channels)]
    return lives, acted


def beat_all(lives: list[Liveness], skip: tuple[int, ...] = (), wait: float = 0.0) -> None:
    """One interval of every rank not in ``skip`` (each sends, then each takes in what arrived: on
    loopback a datagram is queued at the receiver before ``sendto`` returns)."""
    for i, live in enumerate(lives):
        if i not in skip and live.verdict is None:
            live.beat(wait=0.0)
    for i, live in enumerate(lives):
        if i not in skip and live.verdict is None:
            live.beat(wait=wait)


def run_for(lives: list[Liveness], clock: Clock, seconds: int, skip: tuple[int, ...] = ()) -> None:
    for _ in range(seconds):
        clock.advance(1.0)
        beat_all(lives, skip)


def close_all(lives: list[Liveness]) -> None:
    for live in lives:
        live.channel.close()  # a socket closed twice is a no-op
