"""The single `ds-trhash` console script: its subcommand groups and exit codes."""

import pytest

from ds_trhash.cli import build_parser, main


def test_every_subcommand_group_is_registered():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"data", "sft", "eval", "export", "sync", "report", "generate", "demo"} <= set(sub.choices)


def test_a_command_runs_and_returns_its_exit_code(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["data", "fingerprint", str(missing)]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
