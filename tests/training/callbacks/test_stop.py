"""Stop handling in one process: handlers only record, duplicates within the window count once, a
process not started by the deepspeed launcher watches nothing, and StopCallback turns an agreed
stop into a stop request (the multi-rank behaviour: tests/training/test_stop_signals.py)."""

import contextlib
import os
import signal
import time

from ds_trhash.training.callbacks.stop import LauncherWatch, StopAgreement, StopCallback, StopRequests
from ds_trhash.training.loop import TrainState
from ds_trhash.training.signals import EXIT_REQUEUE
from tests.training.callbacks import fakes


def test_handlers_only_record_and_a_duplicate_within_the_window_counts_once():
    before = signal.getsignal(signal.SIGINT)
    requests = StopRequests(window_s=5.0).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # terminal
        os.kill(os.getpid(), signal.SIGINT)  # the same request forwarded again
        os.kill(os.getpid(), signal.SIGTERM)  # launch.py terminating the rank
        time.sleep(0.05)
        assert requests.requested and len(requests.deliveries) == 3 and requests.requests == 2
        assert requests.describe() == "SIGINT x2, SIGTERM (1 duplicate deliveries counted once)"
    finally:
        requests.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_repeat_after_the_window_is_a_new_request():
    requests = StopRequests(window_s=0.01)
    requests.handle(signal.SIGTERM)
    time.sleep(0.05)
    requests.handle(signal.SIGTERM)
    assert requests.requests == 2


def test_signals_the_job_passed_on_before_the_handlers_are_adopted_once_each(tmp_path):
    """What a SLURM job wrote to $DS_TRHASH_PENDING_SIGNALS (a warning, forwarded by the batch shell
    and by the node's task) counts as delivered; names that are no stop signal are passed over."""
    pending = tmp_path / "signals"
    pending.write_text("USR1\nUSR1\nKILL\n$(reboot)\n")
    requests = StopRequests().adopt_pending({"DS_TRHASH_PENDING_SIGNALS": str(pending)})
    assert requests.requeue and requests.requests == 1 and requests.describe() == "SIGUSR1"
    for environ in ({}, {"DS_TRHASH_PENDING_SIGNALS": str(tmp_path / "none")}, {"DS_TRHASH_PENDING_SIGNALS": ""}):
        assert not StopRequests().adopt_pending(environ).requested


def test_single_process_agreement_follows_the_local_request():
    requests = StopRequests()
    stop = StopAgreement(requests, LauncherWatch.for_this_process(), world_size=1, data=fakes.Loader())
    assert not stop() and not stop()
    requests.handle(signal.SIGTERM)
    assert stop() and stop.describe() == "stop requested here: SIGTERM"


def test_a_process_not_started_by_the_launcher_watches_nothing():
    assert LauncherWatch.for_this_process().watched == []
    assert LauncherWatch.for_this_process().gone() is None


def test_stop_callback_turns_an_agreed_stop_into_a_stop_request():
    requests = StopRequests()
    cb = StopCallback(StopAgreement(requests, LauncherWatch(), world_size=1, data=fakes.Loader()))
    state = TrainState(step=1, total_steps=10)
    cb.on_step_end(state, {})
    assert not state.stop_requested
    requests.handle(signal.SIGTERM)
    cb.on_step_end(state, {})
    assert state.stop_requested and state.stop_reason == "stop requested here: SIGTERM"


@contextlib.contextmanager
def _delivered(signum):
    """The recorder installed and ``signum`` sent to this process (which it would have killed without
    the handler); the previous handler back afterwards."""
    before = signal.getsignal(signum)
    requests = StopRequests().install()
    try:
        os.kill(os.getpid(), signum)
        time.sleep(0.05)
        yield requests
    finally:
        requests.uninstall()
    assert signal.getsignal(signum) is before


def test_a_closing_terminal_sighup_is_a_stop_request_like_sigterm():
    with _delivered(signal.SIGHUP) as requests:
        stop = StopAgreement(requests, data=fakes.Loader())
        assert stop() and stop.describe() == "stop requested here: SIGHUP"


def test_the_schedulers_warning_sigusr1_is_a_stop_that_asks_for_a_requeue():
    with _delivered(signal.SIGUSR1) as requests:
        cb = StopCallback(StopAgreement(requests, data=fakes.Loader()))
        state = TrainState(step=3, total_steps=10)
        cb.on_step_end(state, {})
        assert state.stop_requested and state.stop_requeue and state.stop_reason == "stop requested here: SIGUSR1"
    assert EXIT_REQUEUE not in (0, 1, 2)  # distinct from finished, failed and refused


def test_other_stop_signals_do_not_ask_for_a_requeue():
    requests = StopRequests()
    requests.handle(signal.SIGTERM)
    stop = StopAgreement(requests, data=fakes.Loader())
    assert stop() and not stop.requeue and not requests.requeue
