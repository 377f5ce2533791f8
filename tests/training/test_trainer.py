"""Pieces of the stage runner that decide before the model exists."""

import pytest

from ds_trhash.checkpoints.stages import StageError
from ds_trhash.training.callbacks.faults import FaultInjection
from ds_trhash.training.trainer import StageData, check_tokenizer_identity


def _data(tok):
    return StageData(batches=None, total_steps=1, tokenizer_sha256=tok)


def test_next_stage_data_must_use_the_checkpoints_tokenizer():
    check_tokenizer_identity({"tokenizer_sha256": "a" * 64}, _data("a" * 64), "ckpt")
    check_tokenizer_identity({}, _data("a" * 64), "ckpt")  # an export that records none
    with pytest.raises(StageError, match="rebuild the data with the checkpoint's tokenizer"):
        check_tokenizer_identity({"tokenizer_sha256": "a" * 64}, _data("b" * 64), "ckpt")


@pytest.mark.parametrize("spec", ["kill_after:3", "kill_after_step:x", "explode:1"])
def test_fault_injection_rejects_unknown_specs(spec):
    with pytest.raises(ValueError, match="kill_after_step:N or kill_during_save:N"):
        FaultInjection(spec)


def test_fault_injection_is_inert_unless_asked():
    faults = FaultInjection(None)
    faults.maybe_kill("kill_after_step", 0)  # returns: nothing configured
    assert FaultInjection("kill_during_save:4").step == 4


def test_fresh_output_dir_check(tmp_path):
    from ds_trhash.training.launch.checks import LaunchCheckError, check_fresh_output_dir

    check_fresh_output_dir(tmp_path / "new")  # nothing there
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.csv").write_text("step\n")
    with pytest.raises(LaunchCheckError, match="already holds a run"):
        check_fresh_output_dir(tmp_path / "old")
