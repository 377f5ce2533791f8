"""The output directory's lock as a sync holds it (release/hub/lock.py): a second sync fails fast
or waits when allowed, and the trainer's rotation waits for a real ``ds-trhash sync`` process."""
import os
import subprocess
import sys
import threading
import time

import pytest

from ds_trhash.checkpoints import rotate_unless_syncing
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub.sync import SyncError, sync, sync_lock
from tests.release.conftest import TOKEN
from tests.release.hub_fixtures import REPO, UNITS, make_run, quiet, steps_of

def test_a_held_lock_fails_fast_before_any_request_and_waits_when_allowed(tmp_path, server):
    out = make_run(tmp_path)
    with sync_lock(out):
        start = time.monotonic()
        with pytest.raises(SyncError, match="held by another sync"):
            sync(out, REPO, hub.make_api(), prune_local=True, log=quiet)
        assert time.monotonic() - start < 2.0
        with pytest.raises(SyncError, match="held by another sync"):  # one checkpoint of the run: same lock
            sync(out / UNITS[0], REPO, hub.make_api(), log=quiet)
    assert server.requests == [] and steps_of(out) == [10, 20, 30]

    held = threading.Event()

    def holder():
        with sync_lock(out):
            held.set()
            time.sleep(0.3)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    report = sync(out, REPO, hub.make_api(), lock_timeout=5.0, log=quiet)
    thread.join()
    assert report.verified == UNITS


def test_cli_sync_over_http_while_the_trainers_rotation_waits_for_it(tmp_path, server):
    """A real `ds-trhash sync` process, held by the server in its first commit, has the output
    directory's lock: the trainer's rotation deletes nothing meanwhile, and catches up after."""
    out = make_run(tmp_path)
    server.arrived["commit"] = threading.Event()
    gate = server.hold["commit"] = threading.Event()
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ds_trhash.cli", "sync", "--local", str(out), "--repo-id", REPO,
                             "--prune-local", "--keep-last", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert server.arrived["commit"].wait(120), "the sync never reached its first commit"
        lines = []
        assert rotate_unless_syncing(out, keep_last=1, log=lines.append) is None
        assert steps_of(out) == [10, 20, 30] and "rotation deferred" in lines[0]
    finally:
        gate.set()
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "pruned 1" in stdout and steps_of(out) == [20, 30]
    removed = rotate_unless_syncing(out, keep_last=1, keep_unsynced=True, log=quiet)
    assert [p.name for p in removed] == ["step_00000020"] and steps_of(out) == [30]  # verified, so it may go
