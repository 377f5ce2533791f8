"""The script `ds-trhash ops slurm` writes, run as SLURM runs it, on two loopback "nodes".

Stand-ins for `srun` and `scontrol` come first on PATH (tests/prelaunch/slurm_standins/): srun starts the
script's per-node part once per host of SLURM_JOB_NODELIST with the variables slurmstepd sets, and
passes a signal it receives to every process of the step, as slurmstepd does; `scontrol show
hostnames` expands the host list; `scontrol requeue` records the request (tests/prelaunch/slurm_jobs.py
runs the script). The hosts are
`localhost` and `127.0.0.1` (the first, the master address, resolves to loopback), one CPU
process each, the 12-step reference run's arguments.

One job, as a cluster would run it: attempt 0 gets the time-limit warning (SIGUSR1 to the batch
shell alone, as `--signal=B:USR1@T` sends it) mid-run, stops every rank after a checkpoint and asks
for a requeue; attempt 1 (SLURM_RESTART_COUNT=1) gets it as soon as srun has started the nodes'
launchers, before any rank could record it: every rank still takes it when it starts and stops
before its first step, and the job is requeued again; attempt 2 continues with --resume auto to the end. Its
losses, step by step, and its final weights equal the two-process run on one node (the session's
shared reference launch). Another job whose config broke after the script was written fails
once, without a requeue, naming its logs.
"""
from __future__ import annotations

import random
import re
import signal
from pathlib import Path

import psutil
import pytest

from ds_trhash.checkpoints import list_checkpoints, verify
from ds_trhash.prelaunch.slurm_script import master_port
from ds_trhash.training.entrypoint import port_in_use
from tests.fail_closed import ds_trhash
from tests.prelaunch.slurm_jobs import run_job
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

TIMEOUT_S = 300


def _reference_args(out):
    """The session's shared 2-process reference (as tests/training/test_multinode.py's one node)."""
    return L.reference_run(out, micro=4)


def _free_job_id() -> int:
    """A job id whose derived master port is free here."""
    while True:
        job_id = random.randrange(100_000, 1_000_000)
        if not port_in_use("127.0.0.1", master_port(job_id)):
            return job_id


def _write(out: Path, config: str = "ds_configs/tiny/pretrain.yaml") -> Path:
    args = _reference_args(out)
    args[args.index("--config") + 1] = config
    proc = ds_trhash("ops", "slurm", *args, "--nodes", "2", "--gpus-per-node", "1", "--time", "30",
                     "--warning-seconds", "120")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out / "slurm" / "job.sbatch"


def _is_rank(p: psutil.Process) -> bool:
    try:
        return any(arg.startswith("--local_rank") for arg in p.cmdline())  # launch.py passes it to each rank
    except psutil.Error:
        return False


def _run(script: Path, job_id: int, record: Path, attempt: int = 0, warn_after_rows: int | None = None,
         warn_early: bool = False) -> dict:
    """Run the batch script; send SIGUSR1 to the batch shell alone (as `--signal=B:USR1@T` does)
    once ``warn_after_rows`` metrics rows are written, or with ``warn_early`` as soon as both nodes'
    launchers have started, before any rank exists to record it (a rank ignores SIGUSR1 until its
    handlers are installed)."""
    folder = script.parent / "logs" / f"job-{job_id}-attempt-{attempt}"
    metrics = script.parents[1] / "metrics.csv"
    warned: dict = {}

    def watch(proc):
        if warned:
            return
        if warn_early and (folder / "node-0.log").exists() and (folder / "node-1.log").exists():
            warned["ranks_then"] = sum(map(_is_rank, psutil.Process(proc.pid).children(recursive=True)))
        elif warn_after_rows and metrics.exists() and len(rows := metrics.read_text().splitlines()) > warn_after_rows:
            warned["rows_then"] = len(rows) - 1
        else:
            return
        proc.send_signal(signal.SIGUSR1)  # the batch shell alone (B:)

    run = run_job(script, job_id, record, attempt, timeout=TIMEOUT_S, watch=watch)
    return {**run, "warned": warned}


@pytest.fixture(scope="module")
def job(tmp_path_factory, shared_launches):
    """Attempt 0 warned mid-run, attempt 1 warned before its ranks started, attempt 2 to the end."""
    root = tmp_path_factory.mktemp("slurm-job")
    reference = shared_launches.get(2, _reference_args)
    out, record, job_id = root / "run", root / "record", _free_job_id()
    script = _write(out)
    runs, seen = [], []
    for attempt, warning in enumerate(({"warn_after_rows": 2}, {"warn_early": True}, {})):
        runs.append(_run(script, job_id, record, attempt=attempt, **warning))
        seen.append({"record": record.read_text() if record.exists() else "", "checkpoints": list_checkpoints(out)})
    return {"reference": reference, "out": out, "id": job_id, "runs": runs, "seen": seen, "script": script}


def _stop_lines(text: str, done: str = "after a complete checkpoint") -> list[tuple[str, str]]:
    return re.findall(rf"rank (\d)/2: stopped at step (\d+) of 12 {done} \((.*?)\); exiting 75 "
                      r"\(requeue me: --resume auto continues\)", text)


def test_the_warning_stops_every_rank_after_a_checkpoint_and_requeues_the_job(job):
    first = job["runs"][0]
    assert first["code"] == 0, first["output"]
    assert first["warned"], "the run ended before the warning"
    assert "USR1: the time limit is near" in first["output"]
    assert f"requeueing job {job['id']}; its next attempt continues with --resume auto" in first["output"]
    assert job["seen"][0]["record"] == f"requeue {job['id']}\n"  # once, by the batch script
    logs = first["logs"]
    assert sorted(logs) == ["node-0.log", "node-1.log"]
    (rank0, step0, _), = _stop_lines(logs["node-0.log"])
    (rank1, step1, _), = _stop_lines(logs["node-1.log"])
    stop = int(step0)
    assert (rank0, rank1) == ("0", "1") and step1 == step0 and first["warned"]["rows_then"] <= stop < 12
    # the runner and launch.py outlived the warning and passed the ranks' status on
    for name in logs:
        assert "launcher exited with status 75" in logs[name] and "Traceback" not in logs[name]
    saved = job["seen"][0]["checkpoints"][-1]
    assert saved.step == stop and saved.has_manifest
    verify(saved.path)


def test_a_warning_before_the_ranks_started_reaches_them_and_requeues_with_nothing_trained(job):
    """The warning comes before any rank exists: the batch shell writes it where each rank reads
    it when it starts, so it is not lost in the seconds between srun and the ranks' handlers; the
    ranks stop before their first step (nothing to save) and ask for the requeue."""
    second, before = job["runs"][1], job["seen"][0]
    assert second["code"] == 0, second["output"]
    assert second["warned"] == {"ranks_then": 0}, "the warning did not come before the ranks started"
    assert (second["folder"] / "signals").read_text().split()[0] == "USR1"
    assert job["seen"][1]["record"] == before["record"] + f"requeue {job['id']}\n"
    nothing = "before its first step: nothing was trained and no checkpoint was written"
    stop = before["checkpoints"][-1].step
    for node, log in enumerate(second["logs"][f"node-{k}.log"] for k in (0, 1)):
        (rank, step, reason), = _stop_lines(log, nothing)
        assert (int(rank), int(step)) == (node, stop) and "Traceback" not in log, log[-3000:]
    assert "stop requested here: SIGUSR1" in second["logs"]["node-0.log"] + second["logs"]["node-1.log"]
    assert [c.step for c in job["seen"][1]["checkpoints"]] == [c.step for c in before["checkpoints"]]


def test_the_requeued_attempt_continues_to_the_end_once(job):
    last = job["runs"][2]
    assert last["code"] == 0, last["output"]
    assert "the stage is complete" in last["output"]
    assert job["seen"][2]["record"] == job["seen"][1]["record"]  # no further requeue
    stop = job["seen"][0]["checkpoints"][-1].step
    assert f"resume auto: continuing from {job['out']}/checkpoints/step_{stop:08d}" in last["logs"]["node-0.log"]


def test_losses_and_weights_equal_two_processes_on_one_node(job):
    """Attempt 0's steps and the requeued attempt's, bit for bit the uninterrupted reference's."""
    reference, out = job["reference"], job["out"]
    assert L.train_losses(out) == L.train_losses(reference) and len(L.train_losses(out)) == 12
    L.assert_identical(L.model_weights(out / "checkpoints" / "step_00000012"),
                       L.model_weights(reference / "checkpoints" / "step_00000012"))


def test_a_job_whose_config_broke_fails_once_without_a_requeue_naming_its_logs(tmp_path):
    config = tmp_path / "pretrain.yaml"
    config.write_text(Path(L.REPO / "ds_configs" / "tiny" / "pretrain.yaml").read_text())
    out, record, job_id = tmp_path / "run", tmp_path / "record", _free_job_id()
    script = _write(out, str(config))
    with config.open("a") as f:  # edited after the script was written
        f.write("\nno_such_section: {a: 1}\n")
    run = _run(script, job_id, record)
    logs = script.parent / "logs" / f"job-{job_id}-attempt-0"
    assert run["code"] == 2, run["output"]
    said = re.search(rf"error: training failed with exit status 2 \(job {job_id}, attempt 0: node-0 exit 2, "
                     rf"node-1 exit (\d+)\); not requeued; the logs: (\S+)", run["output"])
    assert said and said[2] == f"{logs}/node-*.log", run["output"]
    assert said[1] in ("2", "143")  # its own refusal, or ended by srun (--kill-on-bad-exit) after node 0's
    assert "no_such_section" in run["output"] and "no_such_section" in run["logs"]["node-0.log"]
    assert run["record"] == ""  # scontrol requeue never ran
    assert not list(logs.glob("*.requeue")) and not list_checkpoints(out)
