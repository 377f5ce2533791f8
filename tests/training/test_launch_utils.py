"""The test harness's own rules, in-process: the shared reference launches run once per session
(whichever xdist worker asks first), a "killed" launch is a SIGKILL and not any failure, and a
test that starts a launch must carry the `e2e` marker."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import time

import pytest

from tests.conftest import starts_a_launch
from tests.training import launch_utils as L


def _counting_launch(log):
    """A stand-in for a launch: slow enough for the callers to overlap, counted in ``log``."""

    def launch(nproc, args):
        with open(log, "a") as f:
            f.write(f"{nproc} {args[-1]}\n")
        time.sleep(0.5)
        out = args[-1]
        out.mkdir(parents=True)
        (out / "weights").write_text("trained")
        return subprocess.CompletedProcess(args, 0, "", "")

    return launch


def _ask(root, log, results):
    shared = L.SharedLaunches(root, launch=_counting_launch(log))
    results.put(str(shared.get(2, lambda out: ["--max-steps", "4", out])))


def test_a_shared_launch_runs_once_when_several_workers_ask_at_once(tmp_path):
    log, root = tmp_path / "launches.log", tmp_path / "shared"
    ctx = multiprocessing.get_context("fork")  # two workers of one session: separate processes
    results = ctx.Queue()
    workers = [ctx.Process(target=_ask, args=(root, log, results)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert [w.exitcode for w in workers] == [0, 0]
    outs = {results.get(timeout=5) for _ in workers}
    assert len(outs) == 1 and log.read_text().count("\n") == 1, log.read_text()
    # and a later ask in this process reads the same run without launching
    again = L.SharedLaunches(root, launch=_counting_launch(log)).get(2, lambda out: ["--max-steps", "4", out])
    assert {str(again)} == outs and log.read_text().count("\n") == 1
    # other arguments are another run
    L.SharedLaunches(root, launch=_counting_launch(log)).get(2, lambda out: ["--max-steps", "5", out])
    assert log.read_text().count("\n") == 2


def test_a_shared_launch_that_failed_is_launched_again(tmp_path):
    calls = []

    def flaky(nproc, args):
        calls.append(args)
        args[-1].mkdir(parents=True, exist_ok=True)
        return subprocess.CompletedProcess(args, 1 if len(calls) == 1 else 0, "", "boom")

    shared = L.SharedLaunches(tmp_path, launch=flaky)
    with pytest.raises(AssertionError, match="exit 1"):
        shared.get(1, lambda out: [out])
    assert shared.get(1, lambda out: [out]).is_dir() and len(calls) == 2


def test_was_killed_is_a_sigkill_not_any_failure():
    def proc(code, out=""):
        return subprocess.CompletedProcess([], code, out, "")

    launcher_line = f"[...] exits with return code = {-signal.SIGKILL}"
    assert L.was_killed(proc(-signal.SIGKILL))  # one plain process
    assert L.was_killed(proc(256 - signal.SIGKILL, launcher_line))  # the deepspeed launcher, sys.exit(-9)
    assert not L.was_killed(proc(1, "Traceback ..."))
    assert not L.was_killed(proc(2))
    assert not L.was_killed(proc(256 - signal.SIGKILL))  # without the launcher's word for it


def test_a_launch_is_recognised_and_refused_in_a_test_without_the_marker():
    assert starts_a_launch([f"{L.VENV_BIN}/deepspeed", "--num_gpus", "2", "launch/train.py"])
    assert starts_a_launch(["python", str(L.REPO / "launch" / "train.py"), "--config", "x"])
    assert starts_a_launch(["ds-trhash", "smoke", "--config", "x"])
    assert starts_a_launch(["python", "-m", "ds_trhash.cli", "jobs", "up", "m.toml"])
    assert not starts_a_launch(["python", "-m", "ds_trhash.cli", "jobs", "status", "m.toml"])
    assert not starts_a_launch(["ds-trhash", "preflight", "--config", "x"])
    with pytest.raises(AssertionError, match="not marked @pytest.mark.e2e"):
        subprocess.run([str(L.VENV_BIN / "deepspeed"), "--help"], capture_output=True)
