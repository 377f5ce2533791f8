"""A run's lifecycle through real launches, watched by `sync --watch` against the stand-in Hub.

One output directory, in order:

1. launch A (the `deepspeed` launcher, its own process group) trains while the watcher uploads
   its checkpoints under a prefix; its rank is held still (SIGSTOP) from its first complete
   checkpoint until the watcher has verified that checkpoint on the Hub, so that A is mid-run
   then however slow the machine (a run long enough to outlast the watcher unaided trained 120
   steps, most of them only to make room for this race);
2. launch B into the same directory with `--resume auto` while A is alive (held still from the
   moment it holds its run lock): refused, naming A's pid and host, before it wrote anything;
3. SIGHUP to A's process group (a terminal closing): A stops at a step boundary with a complete
   checkpoint, exits without a traceback, and writes no final/ (it stopped early); its lock
   covers the ranks until they exit, even after the runner is gone;
4. launch C resumes it (`--resume auto`) to the end: final/ (verified) and stage_complete.json,
   then the watcher uploads final/, verifies everything and exits 0.

A finished stage relaunched with `RESUME=auto` keeps its final/ and record unchanged
(tests/training/test_sft_stage.py, whose digest covers them) and writes a missing or damaged one
(test_final_export.py, in process).
"""
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ds_trhash.checkpoints import list_checkpoints, run_lock, verify
from ds_trhash.checkpoints.sync_guard import LOCK_FILE, read_verified
from ds_trhash.release.lifecycle.final import COMPLETE_FILE, FINAL_DIR, final_status, read_completion
from tests.release.conftest import stand_in_hub
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

# of the 157 the embedded plan holds at this batch: A's first checkpoint comes at step 4, and A stops
# (SIGHUP) a step or two after it is let go
STEPS = 24
PREFIX = "runs/tiny-pretrain"
REPO = "me/lifecycle"


def _args(out):
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(STEPS),
            "--set", "batch.micro_batch=4", "--set", "checkpoint.every_steps=4", "--set", "checkpoint.packs=null",
            "--set", "checkpoint.keep_last=2", "--set", "checkpoint.keep_unsynced=true"]


def _wait(what, condition, proc=None, timeout=600):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"launch A ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def server(monkeypatch):
    with stand_in_hub(monkeypatch, deadline_s=1800) as srv:  # three launches: minutes on a loaded machine
        yield srv


def _watcher(out, log):
    """`ds-trhash sync --watch` as a user starts it beside the run, in a process group of its own
    (its passes die with it), so that a failing test can end it: a watch left running would go
    on starting passes for the rest of the session, their errors landing in other tests' output.
    A pass every 2 s: each is a process of its own (half a CPU-second), and A waits for it."""
    return subprocess.Popen([str(L.VENV_BIN / "ds-trhash"), "sync", "--watch", str(out), "--repo", REPO,
                             "--path-in-repo", PREFIX, "--every", "2", "--pass-timeout", "300", "--create-repo"],
                            cwd=L.REPO, env=L.base_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_watched_run_lock_refusal_sighup_resume_to_final(tmp_path, server):
    out = tmp_path / "run"
    with open(tmp_path / "watch.log", "w") as log:
        watcher = _watcher(out, log)
    try:
        _watched_lifecycle(out, server, watcher)
    finally:
        if watcher.poll() is None:
            os.killpg(watcher.pid, signal.SIGKILL)
            watcher.wait()


def _holds_output_lock(pid: int, out: Path) -> bool:
    """Whether process ``pid`` holds the output directory's lock (a flock: /proc/locks lists its
    holder's pid and the file's inode; a waiter's line is marked "->")."""
    try:
        inode = (out / LOCK_FILE).stat().st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()  # 1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4] == str(pid) \
                and fields[5].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


def _hold_still(rank: int, out: Path) -> None:
    """SIGSTOP launch A's rank at a moment it does not hold the output directory's lock: its
    rotation takes that lock for a moment after each checkpoint, and stopped inside it, the rank
    would keep every watch pass out."""
    while True:
        os.kill(rank, signal.SIGSTOP)
        if not _holds_output_lock(rank, out):
            return
        os.kill(rank, signal.SIGCONT)
        time.sleep(0.05)


def _watched_lifecycle(out, server, watcher):
    port = L.free_port()
    a = subprocess.Popen([str(L.VENV_BIN / "deepspeed"), "--num_gpus", "1", "--master_port", str(port),
                          str(L.REPO / "launch" / "train.py"), *_args(out)], cwd=L.REPO, env=L.base_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # 2: a second launch while A is alive is refused before it writes anything (A's rank held
        # still meanwhile: B's start-up takes longer than A's run on a loaded machine)
        _wait("its run lock", lambda: run_lock.read_holder(out).get("pid"), a)
        holder = run_lock.read_holder(out)
        rank = holder["pid"]
        _hold_still(rank, out)
        b = L.single([*_args(out), "--resume", "auto"])
        assert b.returncode == 2, L.explain(b)
        assert f"is in use by a running launch: pid {holder['pid']} on host {holder['host']}" in b.stderr, b.stderr
        assert "Traceback" not in b.stdout + b.stderr
        os.kill(rank, signal.SIGCONT)
        # 1: the watcher backs A up while it trains (A's rank held still from its first checkpoint)
        _wait("A's first checkpoint", lambda: list_checkpoints(out), a)
        _hold_still(rank, out)
        _wait("a checkpoint verified on the Hub while A is mid-run",
              lambda: any(k.startswith("checkpoints/") for k in read_verified(out)), a)
        assert any(p.startswith(f"{PREFIX}/checkpoints/") for p in server.repo(REPO).files)
        # 3: SIGHUP to the launcher's process group, the rank let go
        os.kill(rank, signal.SIGCONT)
        os.killpg(a.pid, signal.SIGHUP)
        a.wait(60)  # the runner has no handler: it is gone at once, the rank goes on to its checkpoint
        if psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE:
            assert (run_lock.is_alive(out) or {}).get("pid") in (rank, None)
        stdout, stderr = a.communicate(timeout=120)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        for seg in L.shm_segments(port):
            seg.unlink(missing_ok=True)
    both = stdout + stderr
    assert "Traceback" not in both, both[-3000:]
    stop = [line for line in both.splitlines() if "stopped at step" in line]
    assert stop and "SIGHUP" in stop[0], both[-3000:]
    stopped_at = int(stop[0].split("stopped at step ")[1].split()[0])
    assert 0 < stopped_at < STEPS
    newest = list_checkpoints(out)[-1]
    assert newest.step == stopped_at and verify(newest.path) == (True, "ok")
    assert not (out / FINAL_DIR).exists() and not (out / COMPLETE_FILE).exists()  # stopped early: no final/
    assert run_lock.is_alive(out) is None  # the kernel released the lock with the rank

    # 4: resumed to the end: final/ then the completion record; the watcher finishes the backup
    c = L.single([*_args(out), "--resume", "auto"])
    assert c.returncode == 0, L.explain(c)
    last = list_checkpoints(out)[-1]
    assert last.step == STEPS and final_status(out, last.path) == (True, "ok")
    assert read_completion(out)["checkpoint"] == f"checkpoints/{last.name}"
    assert watcher.wait(300) == 0, (out.parent / "watch.log").read_text()[-3000:]
    files = server.repo(REPO).files
    assert f"{PREFIX}/{FINAL_DIR}/model.safetensors" in files and all(p.startswith(PREFIX + "/") for p in files)
    assert f"{PREFIX}/checkpoints/{last.name}/MANIFEST.json" in files
