"""SelectionCallback: best/ and selection.json after each epoch checkpoint; kept across a resume."""
import json

from ds_trhash.training.callbacks import SelectionCallback
from ds_trhash.training.callbacks.base import HeldoutResult
from ds_trhash.training.loop import TrainState
from tests.training.callbacks import fakes


def _epoch_checkpoint(cb, tmp_path, step, eval_loss):
    """What the evaluation and checkpointing callbacks tell the others at an epoch end: the
    held-out result, then the complete checkpoint."""
    path = tmp_path / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "weights").write_text(f"step {step}")
    state = TrainState(step=step, total_steps=step)
    cb.on_evaluated(state, HeldoutResult(step=step, epoch=0, eval_loss=eval_loss, eval_ppl=1.0, eval_tokens=10))
    cb.on_checkpoint_saved(step, path)


def test_best_follows_the_rule_and_survives_a_resume(tmp_path):
    run = fakes.run(tmp_path, cfg=fakes.config(kind="sft"))
    cb = SelectionCallback.from_run(run)
    for epoch, (step, loss) in enumerate([(2, 3.0), (4, 2.0), (6, 2.5)]):
        _epoch_checkpoint(cb, tmp_path, step, loss)
        cb.on_epoch_end(TrainState(step=step, total_steps=6, epoch=epoch, epochs_done=epoch + 1, last={"loss": 1.0}))
    doc = json.loads((tmp_path / "selection.json").read_text())
    assert doc["rule"] == "min_eval_loss" and doc["selected"]["step"] == 4
    assert (tmp_path / "best" / "weights").read_text() == "step 4"
    assert run.progress.messages[-1].startswith("best/ = epoch 2 (step 4)")

    resumed = SelectionCallback.from_run(fakes.run(tmp_path, cfg=fakes.config(kind="sft")))
    resumed.on_start(TrainState(step=4, total_steps=6))
    assert [c.step for c in resumed.candidates] == [2, 4]


def test_only_sft_and_only_rank_0(tmp_path):
    assert SelectionCallback.from_run(fakes.run(tmp_path, cfg=fakes.config(kind="pretrain"))) is None
    cb = SelectionCallback.from_run(fakes.run(tmp_path, cfg=fakes.config(kind="sft"), rank=1))
    _epoch_checkpoint(cb, tmp_path, 2, 1.0)
    cb.on_epoch_end(TrainState(step=2, total_steps=4))
    assert not (tmp_path / "selection.json").exists() and not (tmp_path / "best").exists()


def test_a_resume_at_an_epoch_end_adds_the_candidate_the_stopped_run_did_not_publish(tmp_path):
    """Stopped between writing the last epoch's checkpoint and publishing best/: the resumed run
    (RESUME=auto of the finished stage) takes that epoch's results from the checkpoint's record."""
    run = fakes.run(tmp_path, cfg=fakes.config(kind="sft"), loader=fakes.Loader(per_epoch=2))
    cb = SelectionCallback.from_run(run)
    _epoch_checkpoint(cb, tmp_path, 2, 3.0)
    cb.on_epoch_end(TrainState(step=2, total_steps=4, epoch=0, epochs_done=1, last={"loss": 1.5}))
    last = tmp_path / "checkpoints" / "step_00000004"
    last.mkdir(parents=True)
    (last / "weights").write_text("step 4")
    (last / "trainer_state.json").write_text(json.dumps({
        "step": 4, "epoch": 2, "train_loss": 0.75, "eval": {"eval_loss": 2.0, "eval_ppl": 7.4, "eval_tokens": 10},
        "piqa": {"acc": 0.5, "acc_norm": 0.625}}))
    assert json.loads((tmp_path / "selection.json").read_text())["selected"]["step"] == 2

    resumed_run = fakes.run(tmp_path, cfg=fakes.config(kind="sft"), loader=fakes.Loader(per_epoch=2))
    SelectionCallback.from_run(resumed_run).on_start(TrainState(step=4, total_steps=4))
    doc = json.loads((tmp_path / "selection.json").read_text())
    assert [c["step"] for c in doc["candidates"]] == [2, 4] and doc["selected"]["step"] == 4
    assert doc["candidates"][1] == {"epoch": 2, "step": 4, "checkpoint": str(last), "eval_loss": 2.0, "eval_ppl": 7.4,
                                    "eval_tokens": 10, "train_loss": 0.75, "piqa_acc": 0.5, "piqa_acc_norm": 0.625}
    assert (tmp_path / "best" / "weights").read_text() == "step 4"
    assert "candidate added from step_00000004 on resume" in resumed_run.progress.messages[-1]
    before = (tmp_path / "selection.json").read_text()
    SelectionCallback.from_run(resumed_run).on_start(TrainState(step=4, total_steps=4))  # again: nothing to add
    assert (tmp_path / "selection.json").read_text() == before
