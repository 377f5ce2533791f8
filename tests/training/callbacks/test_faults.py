"""Fault injection: the spec is parsed strictly, and the kill lands exactly after the named step.
(The real SIGKILL through the launcher is exercised by the crash-and-resume launch tests.)"""
import os
import signal
import threading

import pytest

from ds_trhash.training.callbacks import faults
from ds_trhash.training.loop import TrainState


@pytest.mark.parametrize("spec", ["kill_after_step", "kill_after_step:x", "explode:3", "oom_at_step:3",
                                  "oom_at_step:3:1:0:9", "oom_at_step:3:x"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError, match="expected kill_after_step:N, kill_during_save:N or hang_after_step:N:RANK"):
        faults.FaultInjection(spec)


def test_oom_at_step_is_due_once_on_its_rank_step_and_micro_step():
    assert not faults.FaultInjection("oom_at_step:3:1", rank=0).out_of_memory_due(3, 0)
    injected = faults.FaultInjection("oom_at_step:3:1:2,kill_after_step:7", rank=1)
    assert injected.due("kill_after_step", 7)
    assert [injected.out_of_memory_due(s, m) for s, m in ((2, 2), (3, 0), (3, 2), (3, 2))] == [False, False, True, False]


def test_kill_after_step_kills_this_process_at_that_step_only(monkeypatch):
    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    cb = faults.FaultCallback(faults.FaultInjection("kill_after_step:3"))
    for step in (1, 2, 4):
        cb.on_step_end(TrainState(step=step, total_steps=5), {})
    assert kills == []
    cb.on_step_end(TrainState(step=3, total_steps=5), {})
    assert kills == [(os.getpid(), signal.SIGKILL)]
    cb.faults.maybe_kill("kill_during_save", 3)  # another kind: no kill
    assert len(kills) == 1


def test_from_env(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "kill_during_save:7")
    f = faults.FaultInjection.from_env()
    assert (f.kind, f.step) == ("kill_during_save", 7)
    monkeypatch.delenv(faults.FAULT_ENV)
    assert faults.FaultInjection.from_env().kind is None


def test_fault_injection_is_inert_unless_asked():
    injected = faults.FaultInjection(None)
    injected.maybe_kill("kill_after_step", 0)  # returns: nothing configured
    assert faults.FaultInjection("kill_during_save:4").step == 4


def test_hang_after_step_blocks_only_the_named_rank_after_that_step():
    fault = faults.FaultInjection("hang_after_step:4:1")
    assert (fault.kind, fault.step, fault.rank) == ("hang_after_step", 4, 1)
    forever = threading.Event()
    fault.maybe_hang(4, 0, forever)  # another rank: returns
    fault.maybe_hang(3, 1, forever)  # another step: returns
    hung = threading.Thread(target=fault.maybe_hang, args=(4, 1, forever), daemon=True)
    hung.start()
    hung.join(0.3)
    assert hung.is_alive()
    forever.set()  # only the test can release it
    hung.join(5)
    assert not hung.is_alive()


@pytest.mark.parametrize("spec", ["hang_after_step:4", "hang_after_step:4:x", "kill_after_step:4:1"])
def test_hang_needs_a_rank_and_only_hang_takes_one(spec):
    with pytest.raises(ValueError, match="hang_after_step:N:RANK"):
        faults.FaultInjection(spec)
