"""`ds-trhash preflight` refuses what the launch refuses, in the same words, for the same
arguments: here the checkpoints whose own records disagree, and what each would set aside, and an
--output-dir that is a regular file (the launch through its entry point, in-process: both stop
before any process group or model)."""

from ds_trhash.cli import main as cli_main
from ds_trhash.run import main as launch_main
from tests.checkpoints.helpers import consistent, engine, save_as
from tests.fail_closed import ds_trhash, tree_digest


def _argv(out, *extra):
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--resume", "auto", *extra]


def test_only_inconsistent_checkpoints_are_refused_alike_and_set_aside_only_when_told(tmp_path, capsys):
    out = tmp_path / "run"
    save_as(out, 4, consistent(2), engine(2))  # step 2's records under step 4's name, sealed
    before = tree_digest(tmp_path)
    assert launch_main(_argv(out)) == 2
    refusal = capsys.readouterr().err.splitlines()[-1]
    assert refusal.startswith("error: --resume auto found checkpoints") and "none verifies" in refusal
    assert "step_00000004 is inconsistent (its folder is step 4, trainer_state.json says step 2)" in refusal
    assert cli_main(["preflight", *_argv(out)]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert f"FAIL  output: {refusal.removeprefix('error: ')}" in lines, lines
    assert tree_digest(tmp_path) == before
    assert cli_main(["preflight", *_argv(out, "--allow-fresh-over-damaged")]) in (0, 2)
    output = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(("PASS  output", "FAIL  output")))
    assert output.startswith("PASS  output: ") and "a fresh start; 1 damaged checkpoint(s) would be set aside (" in output
    assert "step_00000004 is inconsistent" in output and "every file of the earlier run" in output
    assert tree_digest(tmp_path) == before


def _failed(stdout: str) -> dict[str, str]:
    """check name -> detail of each FAIL line `ds-trhash preflight` printed."""
    return dict(line.removeprefix("FAIL  ").split(": ", 1) for line in stdout.splitlines() if line.startswith("FAIL  "))


def test_an_output_dir_that_is_a_file_is_refused_by_preflight_in_the_launchs_words(tmp_path, capsys):
    """The real `ds-trhash preflight` (its console script) and the launch (its entry point,
    in-process: it refuses before any process group or model) say the same of an --output-dir
    that is a regular file, or lies below one; the file and its folder are left as they were."""
    file = tmp_path / "file"
    file.write_text("not a run\n")
    before = tree_digest(tmp_path)
    fresh = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(file)]  # a plain launch
    assert launch_main(fresh) == 2
    refusal = capsys.readouterr().err.splitlines()[-1]
    assert refusal == f"error: --output-dir {file} is a regular file, not a directory; choose a directory path"
    proc = ds_trhash("preflight", *fresh)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert _failed(proc.stdout) == {"output": refusal.removeprefix("error: ")}, proc.stdout
    assert proc.stdout.splitlines()[-1].endswith("1 failed: fix the failed checks before launching"), proc.stdout
    assert tree_digest(tmp_path) == before
    # a path below the file, resuming: the same words from both (preflight in-process here)
    below = file / "run"
    assert launch_main(_argv(below)) == 2
    refusal = capsys.readouterr().err.splitlines()[-1]
    assert refusal == (f"error: --output-dir {below} lies below the regular file {file}, not a directory; "
                       "choose a directory path")
    assert cli_main(["preflight", *_argv(below)]) == 2
    assert _failed(capsys.readouterr().out) == {"output": refusal.removeprefix("error: ")}
    assert tree_digest(tmp_path) == before
