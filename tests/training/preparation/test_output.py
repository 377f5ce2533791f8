"""The output side of a launch, in process: fresh, resume auto over an empty directory, and the
refusals that need only the command line and the output directory (nothing is written)."""
import pytest

from ds_trhash.checkpoints import CheckpointError
from ds_trhash.training.preparation.checks import LaunchCheckError
from ds_trhash.training.preparation.output import check_output_side, requested_resume
from ds_trhash.training.entrypoint import build_arg_parser, config_from_args
from tests.fail_closed import tree_digest


def _side(tmp_path, *extra):
    args = build_arg_parser().parse_args(
        ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(tmp_path / "run"), *extra])
    return check_output_side(config_from_args(args), args, 0), args


def test_a_new_output_directory_is_a_fresh_start(tmp_path, monkeypatch):
    monkeypatch.delenv("RESUME", raising=False)
    side, args = _side(tmp_path)
    assert (side.resume_dir, side.saved, side.init_dir, side.damaged) == (None, None, None, [])
    assert requested_resume(args) is None
    side, args = _side(tmp_path, "--resume", "auto")  # nothing to resume yet: a fresh start too
    assert side.saved is None and requested_resume(args) == "auto"


def test_a_run_is_not_overwritten_and_flags_must_agree(tmp_path, monkeypatch):
    monkeypatch.delenv("RESUME", raising=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("step\n")
    before = tree_digest(tmp_path)
    with pytest.raises(LaunchCheckError, match="already holds a run"):
        _side(tmp_path)
    monkeypatch.setenv("RESUME", "auto")
    with pytest.raises(CheckpointError, match="and RESUME=.auto. disagree; unset one of them"):
        _side(tmp_path, "--resume", str(tmp_path / "elsewhere"))  # --resume and RESUME disagree
    assert tree_digest(tmp_path) == before
