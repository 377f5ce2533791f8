"""A run directory where a model is expected (checkpoints/run_source.py): `generate --model RUN`
and `--init-checkpoint RUN` mean the stage's last checkpoint, and its final/ once cleanup removed
it (`--keep packs` leaves an older pack checkpoint that must not be taken instead)."""
import subprocess

import pytest

from ds_trhash import cli
from tests.fail_closed import REPO, VENV_BIN
from tests.release.run_fixtures import make_run


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
