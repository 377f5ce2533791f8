"""The sbatch script's text (``prelaunch.slurm_script``): what it asks SLURM for, one deepspeed
launcher per node, that bash parses it, and the values it holds quoted and computed as the Python
side has them. The command that writes it and its refusals are tested in test_slurm.py; the script
runs under srun and scontrol stand-ins in test_slurm_launch.py."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ds_trhash.prelaunch.slurm_script import SlurmJob, master_port, render
from ds_trhash.training.signals import EXIT_REQUEUE
from tests.fail_closed import ds_trhash, tree_digest

TINY = "ds_configs/tiny/pretrain.yaml"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One script through the real command: (its result, the script's text, the run folder)."""
    out = tmp_path_factory.mktemp("slurm") / "run"
    proc = ds_trhash("ops", "slurm", "--config", TINY, "--output-dir", str(out), "--nodes", "2", "--gpus-per-node", "1",
                     "--cpus-per-node", "16", "--partition", "gpu", "--account", "proj-42", "--time", "1-02:00:00",
                     "--warning-seconds", "600", "--sbatch-option=--qos=high", "--max-steps", "12",
                     "--set", "training.log_every=1", "--max-lost-node-requeues", "5")
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
    assert "EXIT_PEER_LOST=76" in text and "MAX_LOST_NODE_REQUEUES=5" in text  # --max-lost-node-requeues 5


def test_bash_parses_the_script_and_its_node_part(written):
    _, text, _ = written
    node = re.search(r"<<'NODE'\n(.*?)\nNODE\n", text, flags=re.S)[1]
    for body in (text, node):
        proc = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


def test_the_script_outside_a_slurm_job_says_to_submit_it_and_starts_nothing(written):
    _, _, out = written
    before = tree_digest(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(out / "slurm" / "job.sbatch")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "SLURM_JOB_ID: is not set: submit this script with sbatch" in proc.stderr
    assert tree_digest(out) == before


def _job(tmp_path: Path, run_dir: Path, **changes) -> SlurmJob:
    fields = dict(script=tmp_path / "job.sbatch", workdir=tmp_path / "repo", deepspeed=tmp_path / "bin" / "deepspeed",
                  run_dir=run_dir, nodes=3, gpus_per_node=4, launch_args=["--config", TINY, "--resume", "auto"],
                  job_name="trhash-x", warning_seconds=300)
    return SlurmJob(**{**fields, **changes})


def test_the_builder_asks_for_whole_nodes_and_leaves_out_what_was_not_given(tmp_path):
    text = render(_job(tmp_path, tmp_path / "run", summary="3 node(s) x 4\nplan: tiny"))
    assert re.findall(r"^#SBATCH (.*)$", text, flags=re.M) == [
        "--job-name=trhash-x", "--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=4", "--exclusive",
        "--signal=B:USR1@300", "--requeue", "--open-mode=append", f"--output={tmp_path}/run/slurm/job-%j.out"]
    assert text.splitlines()[:4] == ["#!/bin/bash", f"# Written by `ds-trhash ops slurm`; submit it with: sbatch "
                                     f"{tmp_path}/job.sbatch", "# 3 node(s) x 4", "# plan: tiny"]
    assert "@@" not in text  # every placeholder filled
    assert "MAX_LOST_NODE_REQUEUES=3" in text  # the default limit of requeues after a lost rank
    assert f"[ \"$status\" -eq {EXIT_REQUEUE} ]" in text  # the node part marks a requeue by the ranks' status


def test_the_values_reach_bash_as_written_however_the_paths_are_named(tmp_path):
    """Paths with spaces, quotes and a dollar sign: each shell variable of the batch part holds
    exactly the path, and the port is the one ``master_port`` gives for the job id."""
    odd = tmp_path / "it's a $HOME run"
    job = _job(tmp_path, odd, workdir=tmp_path / "my repo", deepspeed=tmp_path / "b\"in" / "deepspeed")
    text = render(job)
    lines = [line for line in text.splitlines()
             if re.match(r"(export )?(SCRIPT|DS_TRHASH_WORKDIR|DS_TRHASH_DEEPSPEED|RUN_DIR|LOG_ROOT|MASTER_PORT)=", line)]
    assert len(lines) == 6
    shown = "; ".join(lines + ['printf "%s\\n" "$SCRIPT" "$DS_TRHASH_WORKDIR" "$DS_TRHASH_DEEPSPEED" "$RUN_DIR" '
                               '"$LOG_ROOT" "$MASTER_PORT"'])
    for job_id in (1, 123456, 29999):
        proc = subprocess.run(["bash", "-c", shown], env={**os.environ, "SLURM_JOB_ID": str(job_id)},
                              capture_output=True, text=True, check=True)
        assert proc.stdout.splitlines() == [str(job.script), str(job.workdir), str(job.deepspeed), str(odd),
                                            str(odd / "slurm" / "logs"), str(master_port(job_id))]
    assert shlex.join(["launch/train.py", *job.launch_args]) in text
