"""The liveness thread and its public calls: the abort broadcast, the publish guard, the wait of
a rank whose collective failed, and the thread itself on the real clock."""
from __future__ import annotations

import threading
import time

from ds_trhash.training import liveness
from ds_trhash.training.config import load_config
from ds_trhash.training.liveness.phases import Limits
from ds_trhash.training.liveness.verdict import ABORTED
from tests.training.liveness.helpers import Clock, run_for


def test_abort_tells_every_peer_the_reason_and_the_code(ranks):
    clock = Clock()
    lives, acted = ranks(3, clock)
    run_for(lives, clock, 2)
    lives[1].abort("out of memory at step 7 with micro_batch 8", 77)
    (own,) = acted[1]
    assert (own.rank, own.reason, own.code, own.detail) == (1, ABORTED, 77, "out of memory at step 7 with micro_batch 8")
    for r in (0, 2):
        lives[r].beat(wait=0.2)
        (verdict,) = acted[r]
        assert (verdict.rank, verdict.host, verdict.reason, verdict.code) == (1, "host1", ABORTED, 77)
        assert verdict.detail == "out of memory at step 7 with micro_batch 8"


def test_publish_is_refused_once_a_peer_is_silent_and_allowed_while_all_are_heard(ranks):
    clock = Clock()
    lives, acted = ranks(2, clock)
    run_for(lives, clock, 5)
    assert lives[0].publish_refusal() is None
    run_for(lives, clock, 32, skip=(1,))
    assert lives[0].publish_refusal() == "rank 1 was lost (silent)"


def test_a_failed_collective_waits_for_the_verdict_or_returns_when_the_peer_left_in_order(ranks):
    clock = Clock()
    lives, acted = ranks(2, clock)
    run_for(lives, clock, 2)
    found = []
    waiter = threading.Thread(target=lambda: found.append(lives[0].wait_for_verdict(timeout=20)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # no verdict yet, no goodbye: it waits
    run_for(lives[:1], clock, 32)
    waiter.join(10)
    assert found and found[0].rank == 1 and found[0] is acted[0][0]


def test_the_thread_beats_on_the_real_clock_and_closes_with_a_goodbye(ranks):
    limits = Limits(interval_s=0.05, silent_s=0.5, stuck_s=60.0, by_phase={})
    lives, acted = ranks(2, time.monotonic, limits)  # the real clock
    lives[0].start()
    lives[1].start()
    time.sleep(1.2)  # twice the silence limit: both kept hearing each other
    assert acted == [[], []]
    lives[1].close(0)
    time.sleep(1.0)
    assert acted == [[], []] and lives[0].watch.seen[1].left == 0  # gone in order, never lost
    lives[0].close(0)


def test_liveness_is_off_for_one_rank_and_abort_still_ends_with_its_code(monkeypatch, capfd):
    cfg = load_config("ds_configs/tiny/pretrain.yaml", [])
    off = liveness.start(cfg, 0, 1)
    assert isinstance(off, liveness.NoLiveness) and liveness.current() is off
    assert off.publish_refusal() is None and off.wait_for_verdict() is None
    ended = []
    monkeypatch.setattr(liveness, "end_process", ended.append)
    liveness.abort("cannot read shard x", 2)
    assert ended == [2] and "aborting: cannot read shard x; exiting 2" in capfd.readouterr().err


def test_the_time_before_the_thread_starts_is_nobodys_silence(ranks):
    clock = Clock()
    lives, acted = ranks(2, clock)
    clock.advance(45.0)  # made, then the launch took 45 s before the thread started
    for live in lives:
        live.watch.restart(clock())  # what start() does, without the thread
    run_for(lives, clock, 3)
    assert acted == [[], []]


def test_the_limits_come_from_the_config_and_the_data_wait_from_the_hub_budget():
    limits = liveness.limits_of(load_config("ds_configs/tiny/pretrain.yaml", [
        "data.hub_wait_minutes=60", "liveness.stuck_minutes=2", "liveness.eval_minutes=45"]))
    assert (limits.interval_s, limits.silent_s, limits.stuck_s) == (1.0, 30.0, 120.0)
    assert limits.of("forward_backward") == limits.of("step_end") == 120.0
    assert limits.of("eval") == 2700.0 and limits.of("checkpoint") == limits.of("end") == 1800.0
    assert limits.of("data_wait") == limits.of("startup") == 4200.0  # the Hub's 60 minutes and 10 more
