"""The launch checks as plain functions (the launches that reach them are in test_launch_refusals)."""

import pytest

from ds_trhash.training.preparation.checks import (
    LaunchCheckError,
    check_fresh_output_dir,
    check_sft_manifest_unchanged,
    resolve_init_checkpoint,
)


def test_an_sft_set_rebuilt_in_place_is_refused_on_resume():
    check_sft_manifest_unchanged("a" * 64, "a" * 64, "sft")
    check_sft_manifest_unchanged(None, "b" * 64, "sft")  # a checkpoint from before the hash was recorded
    with pytest.raises(LaunchCheckError, match="the SFT set sft changed since the checkpoint: .* bbbbbbbbbbbb"):
        check_sft_manifest_unchanged("a" * 64, "b" * 64, "sft")


def test_a_run_without_a_complete_checkpoint_is_not_an_init_source(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000003").mkdir(parents=True)
    with pytest.raises(LaunchCheckError, match="without a complete checkpoint .*step_00000003 is incomplete"):
        resolve_init_checkpoint(tmp_path / "run")


def test_fresh_output_dir_check(tmp_path):
    check_fresh_output_dir(tmp_path / "new")  # nothing there
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.csv").write_text("step\n")
    with pytest.raises(LaunchCheckError, match="already holds a run"):
        check_fresh_output_dir(tmp_path / "old")
