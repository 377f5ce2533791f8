"""The output side of a launch, in process: fresh, resume auto over an empty directory, and the
refusals that need only the command line and the output directory (nothing is written)."""
import dataclasses

import pytest

from ds_trhash.checkpoints import CheckpointError
from ds_trhash.training.preparation.checks import LaunchCheckError
from ds_trhash.training.preparation.output import check_output_side
from ds_trhash.training.preparation.request import LaunchRequest
from ds_trhash.training.entrypoint import build_arg_parser, launch_config, launch_request
from tests.fail_closed import tree_digest


def _side(tmp_path, *extra):
    args = build_arg_parser().parse_args(
        ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(tmp_path / "run"), *extra])
    request = launch_request(args)
    return check_output_side(launch_config(request), request, 0), request


def test_a_new_output_directory_is_a_fresh_start(tmp_path, monkeypatch):
    monkeypatch.delenv("RESUME", raising=False)
    side, request = _side(tmp_path)
    assert (side.resume_dir, side.saved, side.init_dir, side.damaged) == (None, None, None, [])
    assert request.resume is None
    side, request = _side(tmp_path, "--resume", "auto")  # nothing to resume yet: a fresh start too
    assert side.saved is None and request.resume == "auto"


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


def test_the_environment_is_read_once_into_the_request(tmp_path, monkeypatch):
    """RESUME and TARGET_TOKENS are read by the entry point only: the output checks decide from the
    request, whatever the environment says by then; the request is frozen."""
    monkeypatch.setenv("RESUME", "auto")
    monkeypatch.setenv("TARGET_TOKENS", "1234")
    args = build_arg_parser().parse_args(["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir",
                                          str(tmp_path / "run"), "--set", "seed=3", "--max-steps", "4"])
    request = launch_request(args)
    assert (request.resume_flag, request.resume_env, request.resume, request.target_tokens) == (None, "auto", "auto", "1234")
    assert request.overrides == ("seed=3", f"output_dir={tmp_path / 'run'}", "training.max_steps=4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.fork = True  # type: ignore[misc]
    monkeypatch.delenv("RESUME")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("step\n")  # a run: only a resume may continue it
    assert check_output_side(launch_config(request), request, 0).saved is None  # auto: nothing to resume yet
    with pytest.raises(LaunchCheckError, match="already holds a run"):
        check_output_side(launch_config(request), dataclasses.replace(request, resume_env=None), 0)


def test_modifiers_without_their_option_are_refused_from_the_request(tmp_path):
    request = LaunchRequest(config="ds_configs/tiny/pretrain.yaml", overrides=(f"output_dir={tmp_path / 'run'}",))
    cfg = launch_config(request)
    with pytest.raises(LaunchCheckError, match="--fork modifies --resume DIR"):
        check_output_side(cfg, dataclasses.replace(request, fork=True, resume_env="auto"), 0)
    with pytest.raises(LaunchCheckError, match="--allow-fresh-over-damaged modifies --resume auto"):
        check_output_side(cfg, dataclasses.replace(request, allow_fresh_over_damaged=True), 0)
    assert not (tmp_path / "run").exists()
