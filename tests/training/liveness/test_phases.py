"""The beacon a rank's heartbeat reads and the limits a verdict applies: positions order every
place of a step between start-up and the end, a phase set for a body is undone after it (an
error included), and a phase without a limit of its own takes the stuck limit."""
import pytest

from ds_trhash.training.liveness import phases as P


def test_start_up_comes_before_every_place_of_a_step_and_the_end_after_them():
    assert P.MARK_STARTUP < P.MARK_DATA < P.MARK_FORWARD < P.MARK_OPTIMIZER < P.HOOKS < P.MARK_END
    assert len(set(P.PHASES)) == len(P.PHASES)


def test_at_sets_the_position_and_phase_together():
    beacon = P.Beacon()
    assert (beacon.step, beacon.mark, beacon.phase) == (0, P.MARK_STARTUP, P.STARTUP)
    beacon.at(7, P.MARK_OPTIMIZER, P.OPTIMIZER)
    assert (beacon.step, beacon.mark, beacon.phase) == (7, P.MARK_OPTIMIZER, P.OPTIMIZER)


def test_a_phase_for_a_body_is_undone_after_it_even_when_the_body_raises():
    beacon = P.Beacon()
    beacon.at(3, P.MARK_FORWARD, P.FORWARD_BACKWARD)
    with beacon.during(P.PROBE):
        assert beacon.phase == P.PROBE and (beacon.step, beacon.mark) == (3, P.MARK_FORWARD)
    assert beacon.phase == P.FORWARD_BACKWARD
    with pytest.raises(RuntimeError), beacon.during(P.CHECKPOINT):
        raise RuntimeError("the write failed")
    assert beacon.phase == P.FORWARD_BACKWARD


def test_a_phase_without_its_own_limit_takes_the_stuck_limit():
    limits = P.Limits(interval_s=1.0, silent_s=30.0, stuck_s=300.0, by_phase={P.CHECKPOINT: 1800.0})
    assert limits.of(P.CHECKPOINT) == 1800.0
    assert limits.of(P.OPTIMIZER) == limits.of(P.STEP_END) == 300.0
