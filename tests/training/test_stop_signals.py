"""A stop every rank agrees on, through the real `deepspeed` launcher with two CPU processes.

Four launches share one output directory, each resuming from the checkpoint the previous stop
wrote (so every stop checkpoint is also shown to resume): SIGTERM to one rank only, SIGTERM to
`launch.py`, Ctrl-C (SIGINT to the whole process group), SIGTERM to the `deepspeed` runner.
Right after Ctrl-C, as a user at the returned prompt would, the same command without --resume
is refused naming --resume auto (tests/training/test_stop_relaunch.py, on why such a refusal
was once lost). That a stop checkpoint resumes bit-identically to the uninterrupted run is the
SLURM job's check (tests/prelaunch/test_slurm_launch.py: a warning's stop, requeued, resumed).
Each asserts: both ranks stopped at the same step, right after the signal; no traceback from any
rank; one complete, verifiable checkpoint at that step; the stop well inside the launcher's
grace period; and every rank exiting 0 (the launcher's own status is what DeepSpeed makes of it,
asserted exactly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ds_trhash.checkpoints import list_checkpoints, verify
from ds_trhash.training.callbacks.stop import LAUNCHER_GRACE_S
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = 150  # of the 157 the embedded plan holds at this batch: every launch ends by its signal


def _rows(out: Path) -> int:
    try:
        return len(L.metrics(out))
    except (OSError, ValueError):
        return 0


def _command(out: Path, port: int, *, resume: bool) -> list[str]:
    cmd = [str(L.VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
           str(L.REPO / "launch" / "train.py"), "--config", "ds_configs/tiny/pretrain.yaml",
           "--output-dir", str(out), "--max-steps", str(STEPS), "--set", "batch.micro_batch=4",
           "--set", "training.log_every=1", "--set", "checkpoint.every_steps=1000", "--set", "checkpoint.packs=null",
           "--set", "checkpoint.keep_last=10"]
    return cmd + ["--resume", "auto"] if resume else cmd


def _launch(out: Path, target, *, resume: bool) -> dict:
    """Start a 2-rank launch, wait until it has trained past ``start + 2`` steps, signal ``target``."""
    port = L.free_port()
    cmd = _command(out, port, resume=resume)
    start_rows = _rows(out)
    # Its own session and process group, like a job started from a terminal.
    proc = subprocess.Popen(cmd, cwd=L.REPO, env=L.base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # generous: a loaded machine starts ranks slowly
        while _rows(out) < start_rows + 2:
            assert proc.poll() is None, f"the launch ended before it was signalled: {proc.communicate()}"
            assert time.monotonic() < deadline, "the launch did not train"
            time.sleep(0.2)
        runner = psutil.Process(proc.pid)
        launch_py = runner.children()[0]
        ranks = sorted(launch_py.children(), key=lambda p: int(p.environ().get("RANK", "0")))
        step_at_signal = _rows(out)
        signalled = time.monotonic()
        target(proc, launch_py, ranks)
        stdout, stderr = proc.communicate(timeout=LAUNCHER_GRACE_S + 60)
        ended = time.monotonic()
    finally:
        if proc.poll() is None or any(p.is_running() for p in L.group_processes(proc.pid)):
            L.kill_group(proc)
        for seg in L.shm_segments(port):
            seg.unlink(missing_ok=True)
    return {"code": proc.returncode, "stdout": stdout, "stderr": stderr, "step_at_signal": step_at_signal,
            "seconds": ended - signalled, "out": out}


def _to_rank1(proc, launch_py, ranks):
    ranks[1].send_signal(signal.SIGTERM)


def _to_launch_py(proc, launch_py, ranks):
    launch_py.send_signal(signal.SIGTERM)


def _ctrl_c(proc, launch_py, ranks):
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group


def _to_runner(proc, launch_py, ranks):
    proc.send_signal(signal.SIGTERM)


SCENARIOS = {"one_rank": _to_rank1, "launch_py": _to_launch_py, "ctrl_c": _ctrl_c, "runner": _to_runner}


def _relaunch_without_resume(out: Path) -> subprocess.CompletedProcess:
    """The same command again the moment the prompt is back, without ``--resume``: it waits for
    the stopping ranks' run lock (``DS_TRHASH_RUN_LOCK_WAIT``), so what it meets does not depend
    on how long their stop checkpoint takes."""
    port = L.free_port()
    try:
        return subprocess.run(_command(out, port, resume=False), cwd=L.REPO, capture_output=True, text=True,
                              timeout=600, env=L.base_env(DS_TRHASH_RUN_LOCK_WAIT="300"))
    finally:
        for seg in L.shm_segments(port):
            seg.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def stops(tmp_path_factory):
    """The four stops in turn, each launch resuming the previous one's stop checkpoint, and right
    after Ctrl-C a relaunch without --resume (``relaunch``)."""
    out = tmp_path_factory.mktemp("stops") / "run"
    results = {}
    for i, (name, target) in enumerate(SCENARIOS.items()):
        results[name] = _launch(out, target, resume=i > 0)
        if name == "ctrl_c":
            results["relaunch"] = _relaunch_without_resume(out)
    return results


def _reasons(result: dict) -> dict[str, str]:
    return {rank: reason for rank, _, reason in L.STOP_LINE.findall(result["stdout"] + result["stderr"])}


def _check(result: dict, code: int) -> int:
    both = result["stdout"] + result["stderr"]
    lines = L.STOP_LINE.findall(both)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], f"exit {result['code']}\n{both[-5000:]}"
    steps = {int(s) for _, s, _ in lines}
    assert len(steps) == 1, f"ranks stopped at different steps: {lines}"
    step = steps.pop()
    assert result["step_at_signal"] <= step <= result["step_at_signal"] + 3, (result["step_at_signal"], step)
    assert not L.foreign_tracebacks(both), both[-5000:]
    assert "second SIG" not in both
    assert result["code"] == code, f"exit {result['code']}\n{both[-3000:]}"
    assert result["seconds"] < LAUNCHER_GRACE_S, result["seconds"]
    info = {c.step: c for c in list_checkpoints(result["out"])}
    assert step in info, sorted(info)
    ok, reason = verify(info[step].path, deep=True)
    assert ok, reason
    state = (info[step].path / "trainer_state.json").read_text()
    assert '"reason": "stop signal"' in state and '"world_size": 2' in state
    return step


def test_sigterm_to_one_rank_stops_both_at_the_same_step(stops):
    # Both ranks exit 0, so launch.py and the runner do too.
    _check(stops["one_rank"], code=0)
    assert _reasons(stops["one_rank"]) == {"1": "stop requested here: SIGTERM", "0": "stop requested by another rank"}


def test_sigterm_to_launch_py_reaches_rank_1_through_the_collective(stops):
    r = stops["launch_py"]
    prev = _check(stops["one_rank"], code=0)
    assert f"resuming at step {prev}" in r["stdout"] + r["stderr"]
    # launch.py itself ends with status 1 whenever it handles a signal (DeepSpeed's code).
    _check(r, code=1)
    # launch.py signals rank 1 only after rank 0 exited: rank 1 stopped on rank 0's word.
    assert _reasons(r) == {"0": "stop requested here: SIGTERM", "1": "stop requested by another rank"}


def test_ctrl_c_to_the_process_group_stops_once_despite_the_double_delivery(stops):
    r = stops["ctrl_c"]
    # The runner dies of its own uncaught KeyboardInterrupt (status 130 / -SIGINT); a runner started with
    # SIGINT ignored passes on launch.py's 1 instead (README, docs/stages.md "Stopping"). The ranks exit 0.
    assert r["code"] in (1, 130, -signal.SIGINT)
    _check(r, code=r["code"])
    # Each rank got SIGINT from the terminal (and rank 0 SIGTERM from launch.py): one stop, no
    # "second signal" escalation, one checkpoint.
    reasons = _reasons(r)
    assert all(reason.startswith("stop requested here: SIGINT") for reason in reasons.values()), reasons


def test_a_relaunch_the_moment_the_prompt_is_back_is_refused_naming_resume(stops):
    """After Ctrl-C the prompt returns while the ranks still write their stop checkpoint; the same
    command again is refused on the console, naming --resume auto, and changes nothing: the next
    launch resumes from the Ctrl-C stop's checkpoint."""
    proc = stops["relaunch"]
    console = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "error: " in console, console[-4000:]
    assert "already holds a run" in console and "--resume auto" in console, console[-4000:]
    assert "Traceback" not in console, console[-4000:]
    stopped = _check(stops["ctrl_c"], code=stops["ctrl_c"]["code"])
    assert f"resuming at step {stopped}" in stops["runner"]["stdout"] + stops["runner"]["stderr"]


def test_sigterm_to_the_deepspeed_runner_leaves_no_orphan_training(stops):
    r = stops["runner"]
    assert r["code"] == -signal.SIGTERM  # the runner has no handler and dies at once
    step = _check(r, code=-signal.SIGTERM)
    assert "the deepspeed runner" in r["stderr"] and "is gone" in r["stderr"]
    assert step == max(c.step for c in list_checkpoints(r["out"]))
