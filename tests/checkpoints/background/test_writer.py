"""Checkpoints written off the training thread (checkpoints/background/writer.py): the step returns
while the files are still being written, a second save waits for the first, a failure in the
thread surfaces on the training thread, a kill -9 mid-write publishes nothing and a resume
picks the previous checkpoint. The writer is held on an event, not timed."""
import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from ds_trhash.checkpoints import CheckpointError, find_resumable, list_checkpoints, verify
from ds_trhash.checkpoints.background import BackgroundSaver, PendingFile, host_snapshot, write_torch_file
from ds_trhash.io import sha256_file
from tests.checkpoints.helpers import fake_engine, state


class HeldWriter:
    """write_torch_file, but each file waits until the test releases it."""

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()

    def __call__(self, pending):
        self.started.set()
        assert self.release.wait(30), "the test never released the writer"
        return write_torch_file(pending)


def engine_capture(weights: torch.Tensor):
    """What the capturing checkpoint engine hands over: DeepSpeed's small files written, the
    state file captured in host memory."""
    def capture(tmp):
        fake_engine()(tmp)
        snap, _ = host_snapshot({"module": {"w": weights}})
        return [PendingFile(tmp / "state" / "mp_rank_00_optim_states.pt", snap)]
    return capture


def start(saver, out, step, weights, **kw):
    return saver.start(out, step, capture=engine_capture(weights), trainer_state=state(step), **kw)


def test_the_step_returns_before_the_files_are_written_and_holds_the_state_of_its_step(tmp_path):
    writer = HeldWriter()
    saver = BackgroundSaver(0, 1, write_file=writer)
    weights = torch.arange(1000, dtype=torch.float32)
    start(saver, tmp_path, 4, weights)  # returned although the writer has not written a byte
    assert writer.started.wait(10) and saver.in_flight == 4
    assert list_checkpoints(tmp_path) == [] and saver.poll() is None
    weights.add_(1.0)  # the next optimizer step updates in place
    writer.release.set()
    done = saver.wait()
    assert done.step == 4 and done.path.name == "step_00000004" and saver.in_flight is None
    assert verify(done.path) == (True, "ok")
    saved = torch.load(done.path / "state" / "mp_rank_00_optim_states.pt", weights_only=True)
    assert torch.equal(saved["module"]["w"], torch.arange(1000, dtype=torch.float32))  # the step's values
    manifest = json.loads((done.path / "MANIFEST.json").read_text())["files"]
    assert manifest["state/mp_rank_00_optim_states.pt"]["sha256"] == sha256_file(
        done.path / "state" / "mp_rank_00_optim_states.pt")  # hashed while written = the bytes on disk
    assert set(manifest) == {"latest", "state/mp_rank_00_model_states.pt", "state/mp_rank_00_optim_states.pt",
                             "rng/rank_0.pt", "trainer_state.json"}  # no per-rank record left
    assert not list((tmp_path / "checkpoints").glob("*.tmp*"))


def test_a_second_save_waits_for_the_first(tmp_path):
    writer = HeldWriter()
    saver = BackgroundSaver(0, 1, write_file=writer)
    start(saver, tmp_path, 1, torch.ones(8))
    second = threading.Thread(target=start, args=(saver, tmp_path, 2, torch.ones(8)))
    second.start()
    second.join(0.5)
    assert second.is_alive() and list_checkpoints(tmp_path) == []  # held behind the first
    writer.release.set()
    second.join(30)
    saver.wait()
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]
    assert all(verify(c)[0] for c in list_checkpoints(tmp_path))


def test_a_failure_in_the_thread_surfaces_on_the_training_thread_and_publishes_nothing(tmp_path):
    saver = BackgroundSaver(0, 1)
    start(saver, tmp_path, 3, torch.ones(4))
    saver.wait()

    def full_disk(pending):
        raise OSError(28, "No space left on device", str(pending.path))

    def unpicklable(pending):
        raise TypeError("cannot pickle 'generator' object")

    saver.write_file = full_disk
    start(saver, tmp_path, 6, torch.ones(4))
    with pytest.raises(OSError, match=r"No space left on device: .*step_00000006.tmp"):
        saver.wait()  # the disk's own error, as the launcher reports it (one line per rank)
    assert saver.wait() is None  # raised once; nothing in flight afterwards
    saver.write_file = unpicklable
    start(saver, tmp_path, 9, torch.ones(4))
    with pytest.raises(CheckpointError, match=r"step_00000009 in the background failed on rank 0: TypeError: "
                                              r"cannot pickle .* not published"):
        saver.wait()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    assert find_resumable(tmp_path, log=lambda m: None).step == 3


def test_two_ranks_publish_once_both_wrote_and_a_rank_failure_stops_the_publish(tmp_path):
    barrier = threading.Barrier(2)

    def rank_main(rank, step, fail, errors):
        def write(pending):
            if fail and rank == 1:
                raise OSError(5, "Input/output error")
            return write_torch_file(pending)

        def capture(tmp):
            snap, _ = host_snapshot({"part": torch.full((4,), float(rank))})
            return [PendingFile(tmp / "state" / f"zero_pp_rank_{rank}_optim_states.pt", snap)]

        saver = BackgroundSaver(rank, 2, write_file=write)
        try:
            saver.start(tmp_path, step, capture=capture, trainer_state=state(step, world_size=2), barrier=barrier.wait)
            saver.wait()
        except Exception as exc:
            errors[rank] = exc

    for step, fail in ((5, False), (10, True)):
        errors = {}
        threads = [threading.Thread(target=rank_main, args=(r, step, fail, errors)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if not fail:
            assert errors == {}
    files = json.loads((tmp_path / "checkpoints/step_00000005/MANIFEST.json").read_text())["files"]
    assert {"state/zero_pp_rank_0_optim_states.pt", "state/zero_pp_rank_1_optim_states.pt",
            "rng/rank_0.pt", "rng/rank_1.pt"} <= set(files)
    assert isinstance(errors[1], OSError) and errors[1].errno == 5
    # rank 0 publishes nothing and fails with the same kind of error (a disk error is a disk error there too)
    assert isinstance(errors[0], OSError) and errors[0].errno == 5
    assert "rank 1 failed to write its part of step_00000010.tmp: OSError: [Errno 5]" in str(errors[0])
    assert [c.step for c in list_checkpoints(tmp_path)] == [5]


def test_kill_9_during_the_background_write_leaves_the_previous_checkpoint_newest(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from ds_trhash.checkpoints.background import BackgroundSaver, PendingFile, host_snapshot
        from tests.checkpoints.helpers import fake_engine, state

        def capture(tmp):
            fake_engine()(tmp)
            return [PendingFile(tmp / "state" / "optim.pt", host_snapshot({{"w": torch.ones(1000)}})[0])]

        def kill_at_6(step):
            if step == 6:
                os.kill(os.getpid(), signal.SIGKILL)  # this rank's files are on disk, nothing published

        saver = BackgroundSaver(0, 1, after_write=kill_at_6)
        for step in (3, 6):
            saver.start({str(tmp_path)!r}, step, capture=capture, trainer_state=state(step))
        saver.wait()
        print("not killed")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    root = tmp_path / "checkpoints"
    assert (root / "step_00000006.tmp" / "state" / "optim.pt").is_file()  # written, never published
    assert not (root / "step_00000006").exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3] and verify(root / "step_00000003")[0]
    assert find_resumable(tmp_path, log=lambda m: None).step == 3


def test_a_background_save_is_not_published_once_liveness_is_unhealthy(tmp_path):
    """Rank 0's thread asks the publish guard right before the rename: a rank lost meanwhile (or
    this one frozen) leaves the save in flight unpublished and the previous checkpoint newest."""
    healthy = [None]
    saver = BackgroundSaver(0, 1, may_publish=lambda: healthy[0])
    start(saver, tmp_path, 3, torch.ones(4))
    saver.wait()
    healthy[0] = "this rank did not run for 45 s (frozen or cut off)"
    start(saver, tmp_path, 6, torch.ones(4))
    with pytest.raises(CheckpointError, match=r"step_00000006 .*not published: this rank did not run for 45 s"):
        saver.wait()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3] and verify(list_checkpoints(tmp_path)[0].path)[0]
