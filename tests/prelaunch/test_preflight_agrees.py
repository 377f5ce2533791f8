"""`ds-trhash preflight` refuses what the launch refuses, in the same words, for the same
arguments: here the checkpoints whose own records disagree (the launch through its entry point,
in-process: both stop before any process group or model), and what each would set aside."""

from ds_trhash.cli import main as cli_main
from ds_trhash.run import main as launch_main
from tests.checkpoints.helpers import consistent, engine, save_as
from tests.fail_closed import tree_digest


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
