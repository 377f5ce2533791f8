"""`ds-trhash export` (release/export/command.py) through the CLI's one handler."""
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


def test_exporting_one_checkpoint_twice_writes_the_same_bytes(tmp_path):
    """safetensors orders its header metadata by a hash map seeded anew for each file written (and
    each process): one export through the console script, two through the CLI's main, and every
    file of the three, weights and manifest included, is byte-identical."""
    from tests.fail_closed import ds_trhash
    from tests.release.run_fixtures import make_run

    run = make_run(tmp_path / "run", finished=False)
    step = run / "checkpoints" / "step_00000030"
    proc = ds_trhash("export", "--checkpoint", step, "--out", tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("b", "c"):
        assert main(["export", "--checkpoint", str(step), "--out", str(tmp_path / name)]) == 0
    digests = [tree_digest(tmp_path / name) for name in ("a", "b", "c")]
    assert digests[0] == digests[1] == digests[2] and "model.safetensors" in digests[0]
