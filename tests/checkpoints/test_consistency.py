"""A checkpoint whose own records disagree is not trusted (checkpoints/consistency.py): the folder
name, the trainer state's step and counters, and the engine's step, sample count and schedule
position must tell one story, or the choice of a checkpoint to resume passes over it. Through the
real launch: tests/training/test_run_lock_launches.py."""

import pytest

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import ResumeError, find_resumable, inconsistency, resolve_resume, trusted
from tests.checkpoints.helpers import ROWS, SEQ, consistent, engine, messages, save, save_as

def test_a_checkpoint_whose_records_agree_is_trusted(tmp_path):
    path = save(tmp_path, 4, trainer_state=consistent(4), write_engine_state=engine(4))
    assert inconsistency(path) is None and trusted(path) == (True, "ok")
    skipped = save(tmp_path, 5, trainer_state=consistent(5), write_engine_state=engine(5, skipped=1))
    assert inconsistency(skipped) is None  # DeepSpeed does not step the schedule on a skipped step


@pytest.mark.parametrize("doc_over, engine_kw, needle", [
    ({**consistent(2), "total_steps": 100}, {}, "its folder is step 4, trainer_state.json says step 2"),
    ({"data_cursor": 3 * ROWS}, {}, "data_cursor is 24, but 4 steps of 8 rows end at 32"),
    ({"tokens_seen": 7}, {}, "tokens_seen is 7, but 32 rows of 128 tokens are 4096"),
    ({"supervised_seen": 10**9}, {}, "supervised_seen 1000000000 exceeds tokens_seen"),
    ({"total_steps": 3}, {}, "says step 4 of 3"),
    ({}, {"samples": 5}, "the engine counted 5 samples, 4 steps of 8 rows are 32"),
    ({}, {"schedule": 2}, "the learning-rate schedule is at step 2, trainer_state.json at step 4"),
])
def test_each_disagreement_is_named(tmp_path, doc_over, engine_kw, needle):
    doc = consistent(4, **doc_over)
    path = save_as(tmp_path, 4, doc, engine(doc["step"], **engine_kw))
    assert ck.verify(path) == (True, "ok")  # the manifest was sealed over the records: only they disagree
    ok, reason = trusted(path)
    assert not ok and reason.startswith("inconsistent (") and needle in reason, reason


def test_the_engine_step_is_checked_against_the_state(tmp_path):
    path = save(tmp_path, 4, trainer_state=consistent(4), write_engine_state=engine(2, samples=4 * ROWS, schedule=4))
    assert "the engine state is at step 2, trainer_state.json at step 4" in trusted(path)[1]


def test_resume_auto_falls_back_past_a_forged_step_and_an_explicit_resume_refuses_it(tmp_path):
    save(tmp_path, 3, trainer_state=consistent(3), write_engine_state=engine(3))
    # step_00000004 claiming step 2, every counter and the engine resealed to match step 2
    forged = save_as(tmp_path, 4, consistent(2), engine(2))
    lines, log = messages()
    assert find_resumable(tmp_path, log).step == 3
    assert lines == ["step_00000004 is inconsistent (its folder is step 4, trainer_state.json says step 2) — "
                     "falling back to step_00000003"]
    with pytest.raises(ResumeError, match=r"cannot resume from .*step_00000004: it is inconsistent \(its folder is step 4"):
        resolve_resume(str(forged), None, tmp_path)


def test_init_checkpoint_of_a_run_passes_over_an_inconsistent_last_step(tmp_path):
    from ds_trhash.training.preparation.checks import LaunchCheckError, resolve_init_checkpoint

    lines, log = messages()
    save(tmp_path, 3, trainer_state=consistent(3), write_engine_state=engine(3))
    save(tmp_path, 4, trainer_state=consistent(4, data_cursor=0), write_engine_state=engine(4))
    assert resolve_init_checkpoint(tmp_path, log=log).endswith("step_00000003")
    assert "step_00000004 is inconsistent (data_cursor is 0" in lines[0] and "passed over" in lines[0]
    only = tmp_path / "only"
    save(only, 4, trainer_state=consistent(4, data_cursor=0), write_engine_state=engine(4))
    with pytest.raises(LaunchCheckError, match=r"without a complete checkpoint or final/ \(step_00000004 is inconsistent"):
        resolve_init_checkpoint(only, log=log)
