"""`ds-trhash export` (release/export_command.py) through the CLI's one handler."""
from ds_trhash.cli import main
from tests.fail_closed import tree_digest


def test_a_missing_checkpoint_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    before = tree_digest(tmp_path)
    code = main(["export", "--checkpoint", str(tmp_path / "checkpoints" / "step_00000004"),
                 "--out", str(tmp_path / "export")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "step_00000004" in err
    assert tree_digest(tmp_path) == before  # no export directory, not even a temporary one
