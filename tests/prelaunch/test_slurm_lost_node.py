"""The SLURM script's answers to a lost rank (exit 76) and to a signal that comes before srun,
run as SLURM runs it with the stand-ins of slurm_standins/ (tests/prelaunch/slurm_jobs.py).

Each node's launcher is the stand-in ``node_launcher``: it exits with the status the test gives
its node and, for exit 76, writes the lost-peer record the test gives, as the rank that saw the
loss does (the record's contract: docs/operations.md, "A lost node"). What the script asked of
SLURM is what the `scontrol` stand-in recorded: `update JobId=J ExcNodeList=...` and `requeue J`.
No training runs here; a real warning through a real launch is test_slurm_launch.py's."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from ds_trhash.prelaunch.slurm_script import SlurmJob, render
from tests.prelaunch.slurm_jobs import STANDINS, run_job
from tests.training import launch_utils as L

JOB = 424242
HISTORY = f"job-{JOB}.lost-nodes"


def _script(root: Path, max_requeues: int = 2) -> Path:
    run_dir = root / "run"
    job = SlurmJob(script=run_dir / "slurm" / "job.sbatch", workdir=L.REPO, deepspeed=STANDINS / "node_launcher",
                   run_dir=run_dir, nodes=2, gpus_per_node=1, job_name="trhash-run", warning_seconds=120,
                   launch_args=["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(run_dir),
                                "--resume", "auto"],
                   max_lost_node_requeues=max_requeues, python=Path(sys.executable))
    job.script.parent.mkdir(parents=True)
    job.script.write_text(render(job))
    return job.script


def _record(root: Path, **fields) -> Path:
    path = root / f"record-{len(list(root.glob('record-*')))}.json"
    data = {"rank": 1, "node": 1, "host": "127.0.0.1", "step": 7, "phase": "step", "silent_s": 61.5,
            "reason": "no heartbeat", "detected_by_rank": 0, "time": "2026-12-05T08:00:00Z"}
    path.write_text(json.dumps({**data, **fields}))
    return path


def _lost(script: Path, attempt: int, exits: str, record: Path | None = None, **env) -> dict:
    if record is not None:
        env["STANDIN_LOST_PEER_RECORD"] = str(record)
    return run_job(script, JOB, script.parent / "scontrol.record", attempt, timeout=120,
                   STANDIN_NODE_EXITS=exits, **env)


@pytest.fixture(scope="module")
def three_losses(tmp_path_factory):
    """One job (at most 2 requeues after a lost rank, node9 excluded at submission) whose ranks
    lose a rank on three attempts: node 1's host blamed, then node 0's, then node 1's again."""
    root = tmp_path_factory.mktemp("lost")
    script = _script(root)
    runs = [_lost(script, 0, "76 1", _record(root), SLURM_STANDIN_EXCLUDED="node9"),
            _lost(script, 1, "1 76", _record(root, rank=0, node=0, host="localhost", step=9, reason="stuck in a step"),
                  SLURM_STANDIN_EXCLUDED="node9")]
    runs.append(_lost(script, 2, "76 1", _record(root, step=11), SLURM_STANDIN_EXCLUDED="node9"))
    return {"script": script, "runs": runs}


def test_a_lost_rank_requeues_the_job_without_its_host_added_to_those_excluded(three_losses):
    first = three_losses["runs"][0]
    assert first["code"] == 0, first["output"]
    assert "a rank was lost (exit 76): rank 1 at step 7 (step; no heartbeat; silent 62 s) on host 127.0.0.1" \
        in first["output"]
    assert f"requeueing job {JOB} without 127.0.0.1 (excluded: node9,127.0.0.1) (1 of 2 after a lost rank)" \
        in first["output"]
    assert first["record"] == f"update JobId={JOB} ExcNodeList=node9,127.0.0.1\nrequeue {JOB}\n"
    assert "node-0 exit 76" not in first["output"] and "error" not in first["output"]


def test_each_later_loss_adds_its_host_to_the_hosts_excluded_before(three_losses):
    second = three_losses["runs"][1]
    assert second["code"] == 0, second["output"]
    assert "rank 0 at step 9 (step; stuck in a step; silent 62 s) on host localhost" in second["output"]
    assert second["record"].splitlines()[2:] == [f"update JobId={JOB} ExcNodeList=node9,127.0.0.1,localhost",
                                                 f"requeue {JOB}"]
    history = three_losses["script"].parent / "logs" / HISTORY
    assert history.read_text().splitlines()[:2] == [
        "attempt 0: 127.0.0.1: rank 1 at step 7 (step; no heartbeat; silent 62 s)",
        "attempt 1: localhost: rank 0 at step 9 (step; stuck in a step; silent 62 s)"]


def test_past_the_limit_the_job_ends_with_76_saying_why_and_asks_slurm_nothing(three_losses):
    last, script = three_losses["runs"][2], three_losses["script"]
    assert last["code"] == 76, last["output"]
    assert (f"error: not requeued: job {JOB} was requeued 2 time(s) after a lost rank already "
            f"(--max-lost-node-requeues 2; {script.parent / 'logs' / HISTORY} lists them)") in last["output"]
    assert f"continue the run with: sbatch {script}" in last["output"]
    assert last["record"] == three_losses["runs"][1]["record"]  # no update, no requeue
    assert len((script.parent / "logs" / HISTORY).read_text().splitlines()) == 2


@pytest.mark.parametrize("content", [
    '{"host": "node[1-2]", "rank": 1}',  # a host-list expression: would exclude other nodes
    '{"host": "127.0.0.1,localhost"}',
    '{"host": "x$(touch PWNED)"}',
    '{"host": "node7"}',  # not one of the attempt's hosts
    '["127.0.0.1"]',
    '{"host": "127.0.0.1"',  # cut short
])
def test_a_malformed_record_requeues_without_excluding_a_host_and_counts(tmp_path, content):
    script = _script(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    run = _lost(script, 0, "76 1", bad)
    assert run["code"] == 0, run["output"]
    assert "warning: the lost-peer record cannot be used: " in run["output"]
    assert "; no host is excluded" in run["output"]
    assert run["record"] == f"requeue {JOB}\n"  # no ExcNodeList update
    assert (tmp_path / "run" / "lost_peer.json").read_text() == content  # left as written
    assert not list(tmp_path.rglob("PWNED")) and not (L.REPO / "PWNED").exists()
    assert (script.parent / "logs" / HISTORY).read_text() == "attempt 0: (no host): no record\n"


def test_no_record_from_this_attempt_requeues_without_an_exclusion_and_counts(tmp_path):
    """A record an earlier attempt left (older than this attempt) is not this loss's."""
    script = _script(tmp_path, max_requeues=1)
    stale = tmp_path / "run" / "lost_peer.json"
    stale.parent.mkdir(exist_ok=True)
    stale.write_text(_record(tmp_path).read_text())
    os.utime(stale, (1_000_000_000, 1_000_000_000))
    first = _lost(script, 0, "1 76")
    assert first["code"] == 0, first["output"]
    assert f"warning: this attempt wrote no lost-peer record ({stale}); no host is excluded" in first["output"]
    assert "a rank was lost (exit 76): which one is not recorded" in first["output"]
    assert first["record"] == f"requeue {JOB}\n"
    second = _lost(script, 1, "76 1")  # the limit counts requeues without a host too
    assert second["code"] == 76 and "requeued 1 time(s) after a lost rank already" in second["output"]
    assert second["record"] == first["record"]


def test_an_exclusion_slurm_refuses_still_requeues_saying_the_host_may_come_back(tmp_path):
    script = _script(tmp_path)
    run = _lost(script, 0, "76 1", _record(tmp_path), SLURM_STANDIN_UPDATE_FAILS="1")
    assert run["code"] == 0, run["output"]
    assert "warning: scontrol update ExcNodeList=127.0.0.1 failed; the next attempt may get 127.0.0.1 again" \
        in run["output"]
    assert run["record"] == f"requeue {JOB}\n"


@pytest.mark.parametrize("sig,requeued,said", [
    (signal.SIGUSR1, True, "the time-limit warning came before training started: requeueing job"),
    (signal.SIGTERM, False, "stopped before training started (SIGTERM); nothing was trained in this attempt"),
])
def test_a_signal_before_srun_starts_no_training(tmp_path, sig, requeued, said):
    """The signal comes while the batch shell still asks SLURM for its hosts (a slow controller):
    it is recorded, and the job requeues (the warning) or ends (a stop) without starting srun."""
    script = _script(tmp_path)
    folder = script.parent / "logs" / f"job-{JOB}-attempt-0"
    sent = []

    def watch(proc):
        if not sent and folder.exists():
            proc.send_signal(sig)
            sent.append(sig)

    run = run_job(script, JOB, tmp_path / "scontrol.record", timeout=60, watch=watch,
                  SLURM_STANDIN_HOSTNAMES_DELAY="3", STANDIN_NODE_EXITS="0 0")
    assert sent and run["code"] == 0, run["output"]
    assert said in run["output"]
    assert run["record"] == (f"requeue {JOB}\n" if requeued else "")
    assert run["logs"] == {} and "launcher" not in run["output"]  # srun never ran
    assert (folder / "signals").read_text() == sig.name.removeprefix("SIG") + "\n"
