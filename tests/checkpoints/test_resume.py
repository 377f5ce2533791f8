"""Resume rules: choosing the checkpoint, what must match, what a checkpoint holds."""

import pytest
import torch

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import (
    CheckpointError,
    ResumeError,
    check_output_dir_stage,
    check_resume_compatible,
    inspect_saved_parts,
    resolve_resume,
)
from tests.checkpoints.helpers import CRITICAL, messages, save, state


# --------------------------------------------------------------------------- resolve_resume


def test_resolve_resume_modes(tmp_path):
    lines, log = messages()
    assert resolve_resume(None, None, tmp_path, log) is None and resolve_resume("", "", tmp_path, log) is None
    assert resolve_resume("auto", None, tmp_path, log) is None
    assert "no complete checkpoint" in lines[-1] and "starting fresh" in lines[-1]
    save(tmp_path, 10)
    assert resolve_resume(None, "auto", tmp_path, log).step == 10
    explicit = resolve_resume(str(tmp_path / "checkpoints/step_00000010"), None, tmp_path / "other", log)
    assert explicit.step == 10
    assert ck.read_trainer_state(explicit)["step"] == 10 and str(explicit) == str(explicit.path)


def test_resolve_resume_explicit_broken_dir_is_an_error(tmp_path):
    path = save(tmp_path, 10)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(ResumeError, match=r"cannot resume from .*step_00000010: it is incomplete \(MANIFEST.json"):
        resolve_resume(str(path), None, tmp_path)
    with pytest.raises(ResumeError, match="disagree"):
        resolve_resume("auto", str(path), tmp_path)


# --------------------------------------------------------------------------- resume compatibility


def compat(saved=None, current=None, **kw):
    kw = {"world_size": 1, "lora_enabled": False, "total_steps": 100, **kw}
    check_resume_compatible((saved or state(40)).to_dict(), current or dict(CRITICAL), **kw)


def test_identical_settings_resume():
    compat(current={**CRITICAL, "optimizer.betas": (0.9, 0.95)}, found=dict.fromkeys(ck.REQUIRED_STATE_PARTS, True),
           plan_sha256="a" * 64, stage="pretraining")


def test_every_differing_setting_is_listed_with_old_and_new_values():
    current = {**CRITICAL, "optimizer.lr": 1e-4, "training.epochs": 4, "data.packing.policy": "per_document"}
    del current["data.seq_len"]
    with pytest.raises(ResumeError) as info:
        compat(current=current)
    msg = str(info.value)
    assert "4 difference(s)" in msg
    assert "optimizer.lr: checkpoint 2e-05, this run 0.0001" in msg
    assert "training.epochs: checkpoint 3, this run 4" in msg
    assert "data.packing.policy: checkpoint '<absent>', this run 'per_document'" in msg
    assert "data.seq_len: checkpoint 128, this run '<absent>'" in msg
    assert "--init-checkpoint" in msg


def test_nested_settings_are_compared_key_by_key():
    saved = state(40, training_critical={"optimizer": {"lr": 1.0, "betas": [0.9, 0.95]}})
    with pytest.raises(ResumeError, match=r"optimizer.betas: checkpoint \[0.9, 0.95\], this run \[0.9, 0.99\]"):
        compat(saved, current={"optimizer": {"lr": 1.0, "betas": (0.9, 0.99)}})


def test_world_size_change_points_to_reshard():
    with pytest.raises(ResumeError, match="world_size: checkpoint 1, this run 4 .*--reshard"):
        compat(world_size=4)
    compat(world_size=4, reshard=True)


@pytest.mark.parametrize("saved_lora,run_lora", [(True, False), (False, True)])
def test_lora_and_full_parameter_never_mix(saved_lora, run_lora):
    with pytest.raises(ResumeError, match="lora: checkpoint is (LoRA|full-parameter), this run is"):
        compat(state(40, lora=saved_lora), lora_enabled=run_lora)


@pytest.mark.parametrize("step", [100, 101])
def test_resume_at_or_past_the_end_refused(step):
    with pytest.raises(ResumeError, match=f"at step {step}, at or past the end of this run \\(100 steps\\)"):
        compat(state(step))


def test_a_finished_run_is_accepted_only_where_asked_and_never_past_its_end():
    """--resume auto of a finished stage trains nothing and exits 0 (finished_ok); past the end,
    or an explicit --resume DIR of the last step, stays refused."""
    compat(state(100), finished_ok=True)
    with pytest.raises(ResumeError, match="at step 101, at or past the end"):
        compat(state(101), finished_ok=True)
    with pytest.raises(ResumeError, match="at step 100, at or past the end"):
        compat(state(100))


def test_other_stage_refused():
    with pytest.raises(ResumeError, match="stage: checkpoint 'pretraining', this run 'refinement'"):
        compat(stage="refinement")


def test_changed_plan_file_refused():
    with pytest.raises(ResumeError, match="plan_sha256: checkpoint 'aaa.*this run 'bbb"):
        compat(plan_sha256="b" * 64)


def test_missing_optimizer_scheduler_or_rng_refused():
    with pytest.raises(ResumeError) as info:
        compat(found={"model": True, "optimizer": False, "scheduler": False, "rng": False})
    msg = str(info.value)
    assert "3 difference(s)" in msg
    for part in ("optimizer", "scheduler", "rng"):
        assert f"no {part} state was found" in msg


def test_incomplete_saved_state_refused():
    doc = state(40).to_dict()
    del doc["world_size"]
    with pytest.raises(CheckpointError, match="lacks world_size"):
        check_resume_compatible(doc, CRITICAL, world_size=1, lora_enabled=False, total_steps=100)


def test_output_dir_of_another_stage_refused(tmp_path):
    save(tmp_path, 10)
    check_output_dir_stage(tmp_path, "pretraining")
    with pytest.raises(ResumeError, match="already holds 'pretraining' checkpoints.*this launch is 'refinement'"):
        check_output_dir_stage(tmp_path, "refinement")


def test_inspect_saved_parts_sees_what_is_missing(tmp_path):
    def engine(optimizer, scheduler, optim_files=()):
        def write(tmp):
            (tmp / "state").mkdir()
            torch.save({"module": {}, "optimizer": optimizer, "lr_scheduler": scheduler},
                       tmp / "state/mp_rank_00_model_states.pt")
            for name in optim_files:
                (tmp / "state" / name).write_bytes(b"x")
        return write

    full = save(tmp_path / "a", 1, write_engine_state=engine({"state": {}}, {"last_epoch": 1}))
    assert inspect_saved_parts(full) == {"model": True, "optimizer": True, "scheduler": True, "rng": True}
    bare = save(tmp_path / "b", 1, write_engine_state=engine(None, None))
    assert inspect_saved_parts(bare) == {"model": True, "optimizer": False, "scheduler": False, "rng": True}
    zero = save(tmp_path / "c", 1, write_engine_state=engine(None, {}, ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]))
    assert inspect_saved_parts(zero)["optimizer"] is True
    assert inspect_saved_parts(zero, world_size=2) == {"model": True, "optimizer": False, "scheduler": True,
                                                        "rng": False}
    with pytest.raises(ResumeError, match="no optimizer, scheduler state"):
        ck.load_engine_state(object(), bare)
