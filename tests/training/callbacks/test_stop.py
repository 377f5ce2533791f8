"""Stop signals: the flag, the second signal, handlers restored, main thread only."""
import os
import signal
import threading

import pytest

from ds_trhash.checkpoints import CheckpointError
from ds_trhash.training.callbacks.stop import GracefulStop
from tests.checkpoints.helpers import messages


# --------------------------------------------------------------------------- graceful stop


def test_sigterm_sets_the_flag_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    lines, log = messages()
    with GracefulStop(log=log) as stop:
        assert not stop.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop and stop.received == "SIGTERM"
        assert "writing a checkpoint" in lines[0]
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_graceful_stop_outside_the_main_thread_is_refused():
    errors = []

    def enter():
        try:
            with GracefulStop():
                pass
        except CheckpointError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


def test_stop_callback_turns_the_signal_into_a_stop_request():
    from ds_trhash.training.callbacks import StopCallback
    from ds_trhash.training.loop import TrainState

    state = TrainState(step=1, total_steps=10)
    with GracefulStop(log=lambda _: None) as stop:
        cb = StopCallback(stop)
        cb.on_step_end(state, {})
        assert not state.stop_requested
        os.kill(os.getpid(), signal.SIGTERM)
        cb.on_step_end(state, {})
    assert state.stop_requested
