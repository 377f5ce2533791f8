"""Command-line arguments of launch/train.py turned into a validated config."""

import pytest

from ds_trhash.training.config import ConfigError
from ds_trhash.training.launcher import build_arg_parser, config_from_args, main


def _cfg(*argv):
    return config_from_args(build_arg_parser().parse_args(["--config", "ds_configs/tiny/sft.yaml", *argv]))


def test_cli_flags_become_validated_overrides():
    cfg = _cfg("--output-dir", "/tmp/x", "--max-steps", "7", "--source-stage", "supervised-finetuning",
               "--lora-rank", "4", "--set", "batch.micro_batch=2")
    assert cfg.output_dir == "/tmp/x" and cfg.training.max_steps == 7
    assert cfg.source_stage == "supervised-finetuning"
    assert cfg.lora.enabled and cfg.lora.rank == 4 and cfg.batch.micro_batch == 2
    assert not _cfg("--full-parameter").lora.enabled


def test_contradicting_or_bad_flags_are_refused():
    with pytest.raises(ConfigError, match="--full-parameter"):
        _cfg("--full-parameter", "--lora-rank", "4")
    with pytest.raises(ConfigError, match="max_steps"):
        _cfg("--max-steps", "0")
    with pytest.raises(ConfigError, match="lora.rank"):
        _cfg("--lora-rank", "0")
    with pytest.raises(ConfigError, match="batch.micro_batc"):
        _cfg("--set", "batch.micro_batc=2")


def test_main_reports_config_errors_in_one_line_and_exits_2(capsys):
    rc = main(["--config", "ds_configs/tiny/pretrain.yaml", "--set", "zero.stage=9"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "zero.stage" in err and err.count("\n") == 1
