"""One launch per output folder, with real launches and the order forced, not left to timing.

The test process holds the run lock as the launch that is still finishing (it is a live holder
like any other), starts launch B into the folder, which is empty then, and waits until B says it
waits for the lock (``DS_TRHASH_RUN_LOCK_WAIT``). Only then does the earlier run appear in the
folder, and the lock is released. B must decide about the
folder after it holds the lock: it finds the run, and since its newest checkpoint's records
disagree (a ``step_00000012`` holding step 9's records, its manifest sealed to match), sets that
one aside, says so, resumes the genuine step 9 and ends bit-identical to the uninterrupted run.
Deciding before the lock (the bug) would start fresh over the run.

Then the lock file. The test released its lock as a launch refused before writing does, removing
the file it created, so B (waiting on that file) must notice and lock the file at the path, which
it creates. The test opens that file as a launch waiting for B does. After B exits the path still
names it, so a launch C started while the test holds it is refused; a lock file removed on exit
would let C lock a new file beside the waiter (two holders).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time

import pytest

from ds_trhash.checkpoints import run_lock
from ds_trhash.checkpoints.run_lock import RUN_LOCK
from ds_trhash.training.preparation.checks import DAMAGED_SUFFIX
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS  # 12, a checkpoint every 3 steps


def _forged_copy(ref, staging):
    """The reference run with its last checkpoint replaced by step 9's, whole (manifest and all)."""
    shutil.copytree(ref, staging, ignore=shutil.ignore_patterns(RUN_LOCK, ".sync.lock"))
    last, nine = staging / "checkpoints" / f"step_{STEPS:08d}", staging / "checkpoints" / "step_00000009"
    shutil.rmtree(last)
    shutil.copytree(nine, last)
    return last


def _start(args: list[str], **env: str) -> subprocess.Popen:
    e = L.base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(L.free_port()), **env)
    return subprocess.Popen([sys.executable, str(L.REPO / "launch" / "train.py"), *args], cwd=L.REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, needle: str) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"the launch ended (exit {proc.wait()}) before it said {needle!r}:\n" + "".join(seen)[-4000:])


def test_the_folder_is_decided_under_the_lock_and_the_lock_file_outlives_the_launch(shared_launches, tmp_path):
    ref = shared_launches.get(1, L.reference_run)  # read only
    staging, out = tmp_path / "staging", tmp_path / "run"
    forged = _forged_copy(ref, staging)
    forged_digest = tree_digest(forged)
    held = run_lock.acquire(out)  # the earlier launch, still finishing; the folder is empty
    proc = _start(L.reference_run(out) + ["--resume", "auto"], DS_TRHASH_RUN_LOCK_WAIT="600")
    waiter = -1
    try:
        head = _read_until(proc, "for the run lock of")
        assert "resume auto" not in head  # nothing decided yet
        for child in staging.iterdir():  # the earlier run's files appear while the lock is held
            os.rename(child, out / child.name)
        genuine = {n: tree_digest(out / "checkpoints" / f"step_{n:08d}") for n in (3, 6, 9)}
        # released as a launch refused before writing releases it: the file it created goes with it,
        # so B, waiting on that file, must lock the one at the path (it creates it: it is its own)
        held.release()
        while not (out / RUN_LOCK).exists():
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            time.sleep(0.05)
        waiter = os.open(out / RUN_LOCK, os.O_RDONLY)  # a launch that waits for B holds this file open
        rest, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log = head + rest
    assert proc.returncode == 0, log[-6000:]
    assert (f"step_{STEPS:08d} is inconsistent (its folder is step {STEPS}, trainer_state.json says step 9" in log
            and "falling back to step_00000009" in log and "resuming at step 9" in log), log[-6000:]
    aside = [p for p in (out / "checkpoints").iterdir() if p.name.startswith(f"step_{STEPS:08d}{DAMAGED_SUFFIX}")]
    assert len(aside) == 1 and tree_digest(aside[0]) == forged_digest  # set aside, unchanged
    assert {n: tree_digest(out / "checkpoints" / f"step_{n:08d}") for n in (3, 6, 9)} == genuine
    last = f"checkpoints/step_{STEPS:08d}"
    L.assert_identical(L.model_weights(out / last), L.model_weights(ref / last))

    # the lock file: B kept it, so the waiter's file is the one at the path, and the two exclude each other
    try:
        assert os.fstat(waiter).st_ino == (out / RUN_LOCK).stat().st_ino
        fcntl.flock(waiter, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the waiter's turn: it holds the lock now
        before = tree_digest(out)
        third = L.single(L.reference_run(out) + ["--resume", "auto"])
        assert third.returncode == 2, L.explain(third)
        assert f"{out} is in use by a running launch" in third.stderr, L.explain(third)
        assert tree_digest(out) == before
    finally:
        os.close(waiter)
