"""One running launch per output directory (checkpoints/run_lock.py): rank 0 holds the lock, a
peer rank of the same launch passes its probe, any rank of another launch is refused naming the
holder, and the kernel frees the lock when the holder dies. Through real launches:
tests/release/lifecycle/test_finish.py."""
import os
import signal
import socket

import pytest

from ds_trhash.checkpoints import CheckpointError, run_lock
from ds_trhash.checkpoints.run_lock import RUN_LOCK, RunLocked


def _hold_in_child(out, env):
    """A forked process that takes the lock as rank 0 of a launch with ``env`` and waits."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.environ.update(env)
            run_lock.acquire(out)
            os.write(ready_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    assert os.read(ready_r, 1) == b"1"
    return pid


def _kill(pid):
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_second_rank_0_is_refused_naming_the_holder_until_it_dies(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(run_lock, "_SETTLE_S", 0.2)
    pid = _hold_in_child(out, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "1"})
    try:
        assert run_lock.is_alive(out)["pid"] == pid
        with pytest.raises(RunLocked, match=f"pid {pid} on host {socket.gethostname()}.*127.0.0.1:29500"):
            run_lock.acquire(out)
    finally:
        _kill(pid)
    assert run_lock.is_alive(out) is None  # released by the kernel: no stale lock after kill -9
    lock = run_lock.acquire(out)
    assert run_lock.read_holder(out)["pid"] == os.getpid() and run_lock.is_alive(out)["pid"] == os.getpid()
    lock.release()
    assert run_lock.is_alive(out) is None


def test_a_peer_rank_passes_for_its_own_launch_and_is_refused_for_another(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(run_lock, "_SETTLE_S", 0.2)
    ours = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600", "WORLD_SIZE": "2"}
    run_lock.check_peer(out)  # no lock file yet: rank 0 has not started; nothing is created
    assert not out.exists()
    pid = _hold_in_child(out, ours)  # our rank 0
    try:
        for key, value in ours.items():
            monkeypatch.setenv(key, value)
        run_lock.check_peer(out)
        monkeypatch.setenv("MASTER_PORT", "29601")  # a rank of another launch
        with pytest.raises(RunLocked, match=f"is in use by a running launch: pid {pid}"):
            run_lock.check_peer(out)
    finally:
        _kill(pid)
    run_lock.check_peer(out)  # the holder is gone


def test_a_launch_leaves_the_lock_file_as_it_found_it(tmp_path):
    out = tmp_path / "new"
    run_lock.acquire(out).release()
    assert not out.exists()  # created for the lock only: taken away with it
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "metrics.csv").write_text("step\n")
    run_lock.acquire(existing).release()
    assert sorted(p.name for p in existing.iterdir()) == ["metrics.csv"]
    (existing / RUN_LOCK).write_text('{"pid": 1}\n')  # left by a launch killed with -9
    lock = run_lock.acquire(existing)
    assert run_lock.read_holder(existing)["pid"] == os.getpid()
    lock.release()
    assert (existing / RUN_LOCK).read_text() == '{"pid": 1}\n'


def test_a_lock_that_cannot_be_created_is_a_message(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the output directory should be")
    with pytest.raises(CheckpointError, match=f"cannot create the run lock {blocker / RUN_LOCK}"):
        run_lock.acquire(blocker)
    assert blocker.read_text() == "a file where the output directory should be"


def test_a_launch_that_wrote_keeps_the_lock_file_with_its_record(tmp_path):
    out = tmp_path / "run"
    lock = run_lock.acquire(out)
    lock.keep()  # the launch passed its checks and writes
    lock.release()
    assert run_lock.read_holder(out)["pid"] == os.getpid() and run_lock.is_alive(out) is None
    inode = (out / RUN_LOCK).stat().st_ino
    refused = run_lock.acquire(out)  # a later launch refused before writing: the file as it found it
    refused.release()
    assert (out / RUN_LOCK).stat().st_ino == inode and run_lock.read_holder(out)["pid"] == os.getpid()


def test_a_waiting_launch_locks_the_file_that_is_there_when_a_refused_holder_removed_its_own(tmp_path, monkeypatch):
    """A holder refused before writing removes the lock file it created; a launch that was waiting
    on that file must not end up holding the removed one while a third locks a new file."""
    out = tmp_path / "run"
    first = run_lock.acquire(out)  # created the directory and the file: its release removes both
    said_r, said_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(first.fd)  # the parent's lock is its open file: a forked copy would hold it too
            os.environ[run_lock.WAIT_ENV] = "60"
            run_lock.acquire(out, log=lambda line: os.write(said_w, b"w"))
            os.write(said_w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    try:
        assert os.read(said_r, 1) == b"w"  # the child waits for the lock held here
        first.release()
        assert os.read(said_r, 1) == b"1"
        assert run_lock.read_holder(out)["pid"] == pid and run_lock.is_alive(out)["pid"] == pid
        monkeypatch.setattr(run_lock, "_SETTLE_S", 0.2)
        with pytest.raises(RunLocked, match=f"pid {pid}"):  # one holder: a third launch is refused
            run_lock.acquire(out)
    finally:
        _kill(pid)


def test_the_lock_wait_is_a_number_of_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv(run_lock.WAIT_ENV, "soon")
    with pytest.raises(CheckpointError, match="DS_TRHASH_RUN_LOCK_WAIT='soon' is not a number of seconds"):
        run_lock.acquire(tmp_path / "run")
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(run_lock.WAIT_ENV, "45")
    assert run_lock.wait_seconds() == 45.0
