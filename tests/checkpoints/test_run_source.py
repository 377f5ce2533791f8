"""A run directory where a model is expected (checkpoints/run_source.py): `generate --model RUN`
and `--init-checkpoint RUN` mean the stage's last checkpoint, and its final/ once cleanup removed
it (`--keep packs` leaves an older pack checkpoint that must not be taken instead); a last
checkpoint that is present but damaged is refused, never replaced by final/ or an older one.
Through a launch: tests/training/test_launch_refusals.py."""
import subprocess

import pytest

from ds_trhash import cli
from ds_trhash.checkpoints import MANIFEST
from tests.fail_closed import REPO, VENV_BIN, flip_byte
from tests.release.run_fixtures import copy_run, make_run, tree_digest


@pytest.fixture(scope="module")
def cleaned_run(tmp_path_factory, tokenizer_dir):
    run = make_run(tmp_path_factory.mktemp("run-source") / "run", packs={10: 1}, tokenizer=tokenizer_dir)
    return run


def _generate(capsys, run):
    code = cli.main(["generate", "--model", str(run), "--prompt", "the cat", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def test_generate_from_a_run_folder_before_and_after_cleanup(cleaned_run, capsys):
    err = _generate(capsys, cleaned_run)
    assert f"--model {cleaned_run}: the run's final complete checkpoint is {cleaned_run}/checkpoints/step_00000030" in err
    assert "unknown TRHashConfig keys" not in err and "loaded checkpoint" in err
    assert cli.main(["cleanup", str(cleaned_run), "--keep", "packs"]) == 0
    err = _generate(capsys, cleaned_run)
    assert f"last checkpoint is gone (cleanup); using its {cleaned_run}/final" in err, err
    assert f"loaded export {cleaned_run}/final" in err  # final/ carries the run's tokenizer


def test_init_checkpoint_of_a_cleaned_run_folder_is_its_final(cleaned_run, tmp_path):
    """preflight runs the launch's own resolution and stage guard: the source it names is final/,
    not the pack checkpoint step_00000010 that cleanup kept."""
    if (cleaned_run / "checkpoints" / "step_00000030").exists():
        assert cli.main(["cleanup", str(cleaned_run), "--keep", "packs"]) == 0
    proc = subprocess.run([str(VENV_BIN / "ds-trhash"), "preflight", "--config", "ds_configs/tiny/refine.yaml",
                           "--init-checkpoint", str(cleaned_run), "--output-dir", str(tmp_path / "ref")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    stage = next(line for line in proc.stdout.splitlines() if " stage: " in line)
    assert f"{cleaned_run}/final" in stage and "step_00000010" not in stage, proc.stdout


def test_a_final_without_tokenizer_names_both_fixes(tmp_path, capsys):
    run = make_run(tmp_path / "run")  # a run that set no data.tokenizer: final/ has no tokenizer.json
    assert cli.main(["generate", "--model", str(run / "final"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer.json (its run set no data.tokenizer); pass --tokenizer DIR" in err, err


def _flip_byte(step) -> str:
    """One byte of the model file changed, its size kept: the SHA-256 differs from the manifest."""
    flip_byte(step / "state" / "mp_rank_00_model_states.pt")
    return f"{step.name} is corrupt (state/mp_rank_00_model_states.pt SHA-256 differs from {MANIFEST})"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tokenizer_dir):
    return make_run(tmp_path_factory.mktemp("run-source-damaged") / "run", tokenizer=tokenizer_dir)


@pytest.mark.parametrize("damaged", [(10, 20, 30), (30,)], ids=["every-checkpoint", "the-last-only"])
def test_a_present_but_damaged_last_checkpoint_is_refused_not_taken_for_a_cleanup(finished_run, tmp_path, capsys,
                                                                                 damaged):
    """Neither final/ nor an older checkpoint that verifies stands in for the stage's last while it
    is present: each checkpoint is named with what is wrong with it, and RUN/final is offered."""
    run = copy_run(finished_run, tmp_path / "run")
    wrong = [_flip_byte(run / "checkpoints" / f"step_{step:08d}") for step in damaged]
    before = tree_digest(run)
    code = cli.main(["generate", "--model", str(run), "--prompt", "the cat", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: --model {run}: the completed stage's last checkpoint "
                           f"{run}/checkpoints/step_00000030 is present but cannot be used ("), line
    for needle in wrong + [f"--model {run}/final takes its export explicitly"]:
        assert needle in line, line
    if damaged == (30,):
        assert "step_00000010 verifies but is not the stage's last" in line, line
    assert "gone (cleanup)" not in err and "passed over" not in err
    assert tree_digest(run) == before
