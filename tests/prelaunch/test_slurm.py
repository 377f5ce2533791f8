"""`ds-trhash ops slurm` writes the sbatch script of a launch, or refuses before writing anything.

The script itself runs in tests/prelaunch/test_slurm_launch.py (srun and scontrol stand-ins, two loopback
nodes). Here: what it holds, that bash parses it, and every refusal leaving the disk as it was.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ds_trhash.cli import main
from ds_trhash.prelaunch.slurm import time_limit_seconds, SlurmJobError
from ds_trhash.prelaunch.slurm_script import master_port
from ds_trhash.training.signals import EXIT_REQUEUE
from tests.fail_closed import REPO, assert_clean_refusal, ds_trhash, tree_digest

STANDINS = Path(__file__).parent / "slurm_standins"
TINY = "ds_configs/tiny/pretrain.yaml"


def _job(out: Path, *extra: str) -> list[str]:
    return ["ops", "slurm", "--config", TINY, "--output-dir", str(out), "--nodes", "2", "--gpus-per-node", "1", *extra]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One script through the real command: (its result, the script's text, the run folder)."""
    out = tmp_path_factory.mktemp("slurm") / "run"
    proc = ds_trhash(*_job(out, "--cpus-per-node", "16", "--partition", "gpu", "--account", "proj-42", "--time", "1-02:00:00",
                           "--warning-seconds", "600", "--sbatch-option=--qos=high", "--max-steps", "12",
                           "--set", "training.log_every=1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, (out / "slurm" / "job.sbatch").read_text(), out


def test_the_script_asks_slurm_for_the_job_its_warning_and_a_requeue(written):
    proc, text, out = written
    sbatch = re.findall(r"^#SBATCH (.*)$", text, flags=re.M)
    assert sbatch == ["--job-name=trhash-run", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=1",
                      "--cpus-per-task=16", "--partition=gpu", "--account=proj-42", "--time=1-02:00:00", "--signal=B:USR1@600", "--requeue",
                      "--open-mode=append", f"--output={out}/slurm/job-%j.out", "--qos=high"]
    assert text.startswith("#!/bin/bash\n") and (out / "slurm" / "job.sbatch").stat().st_mode & 0o111
    assert f"wrote {out}/slurm/job.sbatch" in proc.stdout and f"sbatch {out}/slurm/job.sbatch" in proc.stdout
    assert "2 node(s) x 1 process(es) = 2 ranks: micro-batch 4 x grad_accum 1 x 2 = 1,024 tokens" in proc.stdout


def test_one_deepspeed_launcher_per_node_with_its_rank_the_hostfile_and_resume_auto(written):
    _, text, out = written
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\"" in text
    assert re.search(r"srun --nodes=\"\$NODES\" --ntasks=\"\$NODES\" --ntasks-per-node=1 .*bash -c \"\$NODE_PART\"", text)
    launch = re.search(r'exec "\$DS_TRHASH_DEEPSPEED" (.*?)\) >>"\$LOG" 2>&1 &', text, flags=re.S)[1]
    words = shlex.split(launch.replace("\\\n", " "))
    assert words[:10] == ["--hostfile", "$DS_TRHASH_HOSTFILE", "--no_ssh", "--node_rank", "$SLURM_NODEID",
                          "--master_addr", "$MASTER_ADDR", "--master_port", "$MASTER_PORT", "launch/train.py"]
    assert words[10:] == ["--config", TINY, "--output-dir", str(out), "--set", "training.log_every=1",
                          "--max-steps", "12", "--resume", "auto"]
    assert "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))" in text and master_port(123456) == 15000 + 3456
    assert f"EXIT_REQUEUE={EXIT_REQUEUE}" in text and "scontrol requeue \"$SLURM_JOB_ID\"" in text


def test_bash_parses_the_script_and_its_node_part(written):
    _, text, _ = written
    node = re.search(r"<<'NODE'\n(.*?)\nNODE\n", text, flags=re.S)[1]
    for body in (text, node):
        proc = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_an_existing_script_is_kept_unless_forced(written, capsys):
    _, text, out = written
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


def test_the_script_outside_a_slurm_job_says_to_submit_it_and_starts_nothing(written):
    _, _, out = written
    before = tree_digest(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(out / "slurm" / "job.sbatch")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "SLURM_JOB_ID: is not set: submit this script with sbatch" in proc.stderr
    assert tree_digest(out) == before
