"""The verdicts through real datagrams between in-process ranks, on a clock the test moves:
silence names the rank, node, host, step and duration; a watcher's own starvation is never
blamed on its peers; a stuck laggard is named by its phase's limit; long legitimate phases
never trip it; a goodbye is never taken for a loss."""
from __future__ import annotations

import pytest

from ds_trhash.training.liveness.phases import (CHECKPOINT, DATA_WAIT, FORWARD_BACKWARD, HOOKS, MARK_FORWARD,
                                                STEP_END)
from ds_trhash.training.liveness.verdict import SILENT, STUCK
from ds_trhash.training.signals import EXIT_PEER_LOST
from tests.training.liveness.helpers import Clock, beat_all, run_for


@pytest.fixture
def clock():
    return Clock()


def test_a_silent_rank_is_named_with_its_node_host_step_and_silence(clock, ranks):
    lives, acted = ranks(3, clock)
    for live in lives:
        live.beacon.at(7, MARK_FORWARD, FORWARD_BACKWARD)
    run_for(lives, clock, 5)
    assert all(live.verdict is None for live in lives)
    run_for(lives, clock, 29, skip=(2,))  # rank 2 stops answering (last heard at most 1 s later): under the limit
    assert acted == [[], [], []]
    run_for(lives, clock, 3, skip=(2,))
    for r in (0, 1):
        (verdict,) = acted[r]
        assert (verdict.rank, verdict.node, verdict.host, verdict.step, verdict.phase, verdict.reason) == (
            2, 2, "host2", 7, FORWARD_BACKWARD, SILENT)
        assert 30 < verdict.silent_s <= 32 and verdict.code == EXIT_PEER_LOST and not verdict.itself


def test_own_starvation_is_not_blamed_on_the_peers(clock, ranks):
    lives, acted = ranks(2, clock)
    run_for(lives, clock, 3)
    clock.advance(25.0)  # rank 0's watcher did not run for 25 s (rank 1's neither: same process)
    beat_all(lives)
    run_for(lives, clock, 10)
    assert acted == [[], []] and lives[0].publish_refusal() is None


def test_a_watcher_stopped_longer_than_the_limit_names_itself_and_refuses_to_publish(clock, ranks):
    lives, acted = ranks(2, clock)
    lives[0].beacon.at(12, MARK_FORWARD, FORWARD_BACKWARD)
    run_for(lives, clock, 3)
    clock.advance(45.0)  # SIGSTOPped for 45 s, then SIGCONT
    assert "did not run for 4" in lives[0].publish_refusal()  # a save thread asking first is refused
    lives[0].beat(wait=0.0)
    (verdict,) = acted[0]
    assert verdict.itself and verdict.rank == 0 and verdict.step == 12 and verdict.silent_s >= 45
    assert verdict.code == EXIT_PEER_LOST


def test_every_peer_of_two_other_nodes_silent_means_this_node_is_cut_off(clock, ranks):
    lives, acted = ranks(4, clock, nodes=[0, 0, 1, 2])
    run_for(lives, clock, 2)
    for _ in range(32):  # node 0 (ranks 0 and 1) hears only itself; nodes 1 and 2 only each other
        clock.advance(1.0)
        lives[0].beat(wait=0.0)
        lives[2].beat(wait=0.0)
        lives[3].beat(wait=0.0)
        # ranks 0/1 and 2/3 exchange nothing: rank 1 is left silent; the datagrams between 0 and 2, 3 are dropped
        for live in lives:
            live.channel.receive(0.0)
    lives[0].beat(wait=0.0)
    (verdict,) = acted[0]
    assert verdict.itself and verdict.rank == 0 and "2 other nodes" in verdict.detail


def test_the_laggard_is_named_stuck_in_its_phase_past_that_phase_limit(clock, ranks):
    lives, acted = ranks(3, clock)
    lives[1].beacon.at(10, HOOKS + 1, STEP_END)  # rank 1 hangs after step 10 ...
    for r in (0, 2):
        lives[r].beacon.at(11, MARK_FORWARD, FORWARD_BACKWARD)  # ... the others wait in step 11
    run_for(lives, clock, 299)
    assert acted == [[], [], []]
    run_for(lives, clock, 3)
    for r in range(3):  # every rank, the stuck one included
        (verdict,) = acted[r]
        assert (verdict.rank, verdict.reason, verdict.phase, verdict.step) == (1, STUCK, STEP_END, 10)
        assert verdict.silent_s > 300 and verdict.itself == (r == 1)


def test_long_legitimate_phases_and_a_world_in_step_never_trip_it(clock, ranks):
    lives, acted = ranks(2, clock)
    lives[0].beacon.at(10, HOOKS + 5, CHECKPOINT)  # rank 0 writes a checkpoint for 20 minutes
    lives[1].beacon.at(11, MARK_FORWARD, FORWARD_BACKWARD)
    run_for(lives, clock, 1200)
    for live in lives:  # then both wait for the Hub together for 20 minutes: nobody is ahead
        live.beacon.at(12, 0, DATA_WAIT)
    run_for(lives, clock, 1200)
    assert acted == [[], []]


def test_a_rank_that_said_goodbye_is_not_lost_and_a_failed_one_stops_judging(clock, ranks):
    lives, acted = ranks(3, clock)
    run_for(lives, clock, 2)
    lives[2].close(0)  # finished first
    run_for(lives[:2], clock, 40)
    assert acted == [[], [], []]
    lives[1].close(1)  # failed with its own error
    run_for(lives[:1], clock, 1)
    assert lives[0].wait_for_verdict(timeout=5) is None  # at once: its own message tells the story
    run_for(lives[:1], clock, 40)
    assert acted[0] == []


def test_a_verdict_is_adopted_by_the_other_ranks_at_once(clock, ranks):
    lives, acted = ranks(3, clock)
    run_for(lives, clock, 2)
    lives[0].channel.receive(0.0)
    lives[0].watch.seen[2].heard_at = clock.now - 31  # rank 0 alone stopped hearing rank 2
    lives[0].beat(wait=0.0)
    assert acted[0][0].rank == 2 and acted[0][0].detected_by_rank == 0
    lives[1].beat(wait=0.2)
    lives[2].beat(wait=0.2)
    assert [(v.rank, v.detected_by_rank, v.itself) for v in acted[1] + acted[2]] == [(2, 0, False), (2, 0, True)]
