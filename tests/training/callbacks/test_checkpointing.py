"""CheckpointCallback: what it saves when, epoch ends with their evaluation results, rotation,
saves written in the background and finished before anything reads them."""
import threading

import pytest

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.sync_guard import output_lock, update_verified
from ds_trhash.io import sha256_file
from ds_trhash.training.callbacks import Callback, CheckpointCallback, make_callbacks
from ds_trhash.training.callbacks.base import HeldoutResult
from ds_trhash.training.loop import TrainState
from tests.training.callbacks import fakes


def _steps(tmp_path):
    return [c.step for c in ckpt.list_checkpoints(tmp_path)]


def test_cadence_pack_boundary_stop_and_final(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=3), protect_steps={5})
    cb = CheckpointCallback.from_run(run)
    told = fakes.told(run)
    state = TrainState(step=0, total_steps=8)
    for step in range(1, 8):
        state.step = step
        state.stop_requested = step == 7
        cb.on_step_end(state, fakes.metrics(step))
    cb.wait()  # step 7's may still be written in the background
    assert _steps(tmp_path) == [3, 5, 6, 7]
    reasons = [ckpt.read_trainer_state(c)["reason"] for c in ckpt.list_checkpoints(tmp_path)]
    assert reasons == ["every_steps", "token pack boundary", "every_steps", "stop signal"]
    assert [(step, path.name) for step, path in told.saved] == [(s, f"step_{s:08d}") for s in (3, 5, 6, 7)]
    assert all(ckpt.verify(c)[0] for c in ckpt.list_checkpoints(tmp_path))
    cb.on_end(state)  # stopped before the end: no "final" checkpoint
    assert _steps(tmp_path) == [3, 5, 6, 7]
    state.step = 8
    cb.on_end(state)
    assert ckpt.read_trainer_state(tmp_path / "checkpoints" / "step_00000008")["reason"] == "final"


def test_epoch_end_is_saved_once_with_the_evaluation_results(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=1), loader=fakes.Loader(per_epoch=2))
    cb = CheckpointCallback.from_run(run)
    state = TrainState(step=2, total_steps=4, epoch=0, epochs_done=1)
    run.callbacks.append(cb)
    run.evaluated(state, HeldoutResult(step=2, epoch=1, eval_loss=1.25, eval_ppl=3.5, eval_tokens=8))
    run.model.forward("train")
    cb.on_step_end(state, fakes.metrics(2))  # the epoch boundary: left to on_epoch_end
    assert _steps(tmp_path) == []
    run.model.forward("eval")  # held-out loss / PIQA run between the step and the epoch checkpoint
    cb.on_epoch_end(state)
    cb.on_end(TrainState(step=2, total_steps=2))  # same step again: not written twice
    saved = ckpt.read_trainer_state(tmp_path / "checkpoints" / "step_00000002")
    assert saved["reason"] == "end of epoch 1" and saved["piqa"] is None
    assert saved["eval"] == {"eval_loss": 1.25, "eval_ppl": 3.5, "eval_tokens": 8, "step": 2, "epoch": 1}
    # the kernel path recorded is the training step's, not the evaluation forward's
    assert saved["backends_used"] == {"experts": "pytorch", "loss": "chunked", "norm": "train"}
    assert 2 in cb.protect and len(run.engine.saves) == 1


def test_rotation_keeps_the_newest_and_protected(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=1, keep_last=2), protect_steps={1})
    cb = CheckpointCallback.from_run(run)
    state = TrainState(step=0, total_steps=10)
    for step in range(1, 6):
        state.step = step
        cb.on_step_end(state, fakes.metrics(step))
    cb.wait()
    assert _steps(tmp_path) == [1, 4, 5]


def test_rotation_waits_while_a_sync_holds_the_lock_and_keeps_what_no_sync_verified(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=1, keep_last=1, keep_unsynced=True))
    cb = CheckpointCallback.from_run(run)
    state = TrainState(step=0, total_steps=10)

    def step_to(n):
        state.step = n
        cb.on_step_end(state, fakes.metrics(n))
        cb.wait()

    with output_lock(tmp_path):  # what `ds-trhash sync` holds while it uploads
        step_to(1), step_to(2)
    assert _steps(tmp_path) == [1, 2] and "rotation deferred" in " ".join(run.progress.messages)
    step_to(3)  # lock free, but nothing is verified on the Hub: nothing rotates
    assert _steps(tmp_path) == [1, 2, 3]
    manifest = tmp_path / "checkpoints" / "step_00000001" / ckpt.MANIFEST
    update_verified(tmp_path, add={"checkpoints/step_00000001": {"manifest_sha256": sha256_file(manifest)},
                                   "checkpoints/step_00000002": {"manifest_sha256": "0" * 64}})  # another manifest
    step_to(4)
    assert _steps(tmp_path) == [2, 3, 4]  # only the checkpoint verified with its current manifest went


def test_a_resume_at_the_last_step_saves_nothing_and_hooks_run_before_each_save(tmp_path):
    """A finished run resumed (RESUME=auto after its end) does not write its last checkpoint
    again; every save is preceded by every callback's before_save hook (expert load flushed first)."""
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=2), loader=fakes.Loader(per_epoch=3))
    seen = []

    class Watcher(Callback):
        def before_save(self, st):
            seen.append((st.step, _steps(tmp_path)))

    cb = make_callbacks([CheckpointCallback.from_run, lambda run: Watcher()], run)[0]  # fills run.callbacks
    state = TrainState(step=0, total_steps=3)
    cb.on_start(state)
    for step in (1, 2, 3):
        state.step, state.epochs_done, state.last = step, step // 3, {"loss": 4.0 - step}
        cb.on_step_end(state, fakes.metrics(step))
        if step == 3:
            cb.on_epoch_end(state)
    cb.on_end(state)
    assert seen == [(2, []), (3, [2])]  # each hook ran before its checkpoint existed
    assert ckpt.read_trainer_state(tmp_path / "checkpoints" / "step_00000003")["train_loss"] == 1.0
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")}

    resumed = CheckpointCallback.from_run(fakes.run(tmp_path, cfg=fakes.config(every_steps=2)))
    finished = TrainState(step=3, total_steps=3)
    resumed.on_start(finished)
    resumed.on_end(finished)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").rglob("*")} == before


def test_a_background_failure_surfaces_at_the_next_step_and_close_finishes_the_save_in_flight(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=1))
    cb = CheckpointCallback.from_run(run)
    told = fakes.told(run)
    state = TrainState(step=1, total_steps=10)

    def broken(step):
        raise RuntimeError("the state holds an unpicklable object")

    cb.saver.after_write = broken
    cb.on_step_end(state, fakes.metrics(1))  # the step itself returns: the write fails later
    state.step = 2
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000001 in the background failed.*unpicklable"):
        cb.on_step_end(state, fakes.metrics(2))
    assert _steps(tmp_path) == []

    held = threading.Event()
    cb.saver.after_write = lambda step: held.wait(30)
    state.step = 3
    cb.on_step_end(state, fakes.metrics(3))
    closing = threading.Thread(target=cb.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive() and _steps(tmp_path) == []  # close waits for the write in flight
    held.set()
    closing.join(30)
    assert _steps(tmp_path) == [3] and [(step, path.name) for step, path in told.saved] == [(3, "step_00000003")]
    assert "on the step" in run.progress.messages[-1] and "written in the background" in run.progress.messages[-1]
