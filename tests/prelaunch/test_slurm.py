"""`ds-trhash ops slurm` writes the sbatch script of a launch, or refuses before writing anything.

The script itself runs in tests/prelaunch/test_slurm_launch.py (srun and scontrol stand-ins, two loopback
nodes); what it holds is tested in tests/prelaunch/test_slurm_script.py. Here: the command, every
refusal leaving the disk as it was, --submit, the time limits.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ds_trhash.cli import main
from ds_trhash.prelaunch.slurm import time_limit_seconds, SlurmJobError
from tests.fail_closed import REPO, assert_clean_refusal, ds_trhash, tree_digest

STANDINS = Path(__file__).parent / "slurm_standins"
TINY = "ds_configs/tiny/pretrain.yaml"


def _job(out: Path, *extra: str) -> list[str]:
    return ["ops", "slurm", "--config", TINY, "--output-dir", str(out), "--nodes", "2", "--gpus-per-node", "1", *extra]


def test_an_existing_script_is_kept_unless_forced(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert main(_job(out, "--cpus-per-node", "16")) == 0
    text = (out / "slurm" / "job.sbatch").read_text()
    before = tree_digest(out)
    code = main(_job(out, "--nodes", "1"))  # another shape for the same run
    assert code == 2 and "job.sbatch exists already; nothing was written. Pass --force" in capsys.readouterr().err
    assert tree_digest(out) == before
    assert main(_job(out, "--script", str(out / "other.sbatch"), "--nodes", "1")) == 0
    assert "--nodes=1" in (out / "other.sbatch").read_text() and (out / "slurm" / "job.sbatch").read_text() == text
    assert "#SBATCH --exclusive\n" in (out / "other.sbatch").read_text()  # whole nodes unless --cpus-per-node
    assert main(_job(out, "--script", str(out / "other.sbatch"), "--force")) == 0
    assert "--nodes=2" in (out / "other.sbatch").read_text()


@pytest.mark.parametrize("extra, needle", [
    (["--set", "training.no_such_key=1"], "training.no_such_key"),
    (["--nodes", "3"], "--nodes 3 x --gpus-per-node 1 = 3 ranks: "),
    (["--time", "4", "--warning-seconds", "300"], "--warning-seconds 300 is not shorter than the time limit --time 4"),
    (["--time", "an hour"], "--time 'an hour' is not a SLURM time limit"),
    (["--resume", "runs/other/checkpoints/step_00000003"], "a SLURM job always continues its own run (--resume auto)"),
    (["--partition", "gpu; rm -rf /"], "--partition 'gpu; rm -rf /' is not one SLURM word"),
    (["--sbatch-option", "qos=high"], "--sbatch-option 'qos=high' is not an sbatch option"),
    (["--set", "data.plan=no/such/plan.json"], "data.plan"),
])
def test_a_job_that_would_fail_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, extra, needle):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    before = tree_digest(tmp_path)
    assert main(_job(out, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-trhash ops slurm: error: ") and needle in err, err
    assert tree_digest(tmp_path) == before and not out.exists()


def test_a_bad_config_through_the_real_command_changes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / TINY).read_text() + "\nno_such_section: {a: 1}\n")
    before = tree_digest(tmp_path)
    proc = ds_trhash(*_job(tmp_path / "run"), "--config", str(bad))
    assert_clean_refusal(proc, "no_such_section")
    assert tree_digest(tmp_path) == before
    proc = ds_trhash(*_job(tmp_path / "run"), "--nodes", "0")
    assert_clean_refusal(proc, "argument --nodes: must be at least 1, got 0")
    assert tree_digest(tmp_path) == before
    proc = ds_trhash(*_job(tmp_path / "run"), "--max-lost-node-requeues", "-1")
    assert_clean_refusal(proc, "argument --max-lost-node-requeues: must be at least 0, got -1")
    assert tree_digest(tmp_path) == before


def test_submit_runs_sbatch_on_the_written_script_and_refuses_without_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    record = tmp_path / "record"
    monkeypatch.setenv("SLURM_STANDIN_RECORD", str(record))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no sbatch here
    assert main(_job(tmp_path / "run", "--submit")) == 2
    assert "--submit: no `sbatch` on PATH" in capsys.readouterr().err and not (tmp_path / "run").exists()
    monkeypatch.setenv("PATH", f"{STANDINS}:/usr/bin:/bin")
    assert main(_job(tmp_path / "run", "--submit")) == 0
    assert "Submitted batch job 4242" in capsys.readouterr().out
    assert record.read_text() == f"sbatch {tmp_path / 'run' / 'slurm' / 'job.sbatch'}\n"


def test_slurm_time_limits_in_seconds():
    assert [time_limit_seconds(t) for t in ("30", "30:15", "2:00:00", "1-0", "1-2:30", "1-02:30:05", "UNLIMITED")] == [
        1800, 1815, 7200, 86400, 95400, 95405, None]
    with pytest.raises(SlurmJobError):
        time_limit_seconds("0")
