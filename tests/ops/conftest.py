"""One supervised run of the demo's three stages, shared by the jobs and report tests.

`ds-trhash jobs up` starts a real supervisord on a temporary socket with a manifest that runs
pretraining as one plain process (the victim: its rank is SIGKILLed mid-run; a plain process
instead of the deepspeed launcher keeps the test within its time budget, the launcher path
differs only in how the exit status reaches supervisord) and, beside it, the same pretraining uninterrupted as a plain process (the reference), followed by
refinement and SFT chained with `after` (from the reference, so that the chain runs while the
victim restarts), refinement started again once finished (as after a reboot), and a command job
that records what it received. The fixture waits for all
of them, then `ds-trhash jobs stop` ends everything.
"""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.training import launch_utils as L

STEPS = 16  # long enough that the SIGKILL lands mid-run on a loaded machine
EVERY = 2  # checkpoint interval of the pretraining runs
KILL_AFTER_STEP = 3
SECRET = "DS_TRHASH_TEST_TOKEN"
SECRET_VALUE = "tok-4f1e-only-for-the-probe-job"
PROBE_ARGS = ["a b", "it's \"quoted\"", "50% #1; done", "$HOME", "back\\slash"]
TIMEOUT_S = 900


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "ds_trhash.cli", *args], cwd=L.REPO, capture_output=True, text=True,
                          timeout=timeout, env=env or L.base_env())


def _train_args(config, out, steps, *extra):
    return ["launch/train.py", "--config", f"ds_configs/tiny/{config}", "--output-dir", str(out),
            "--max-steps", str(steps), "--set", "training.log_every=1", *extra]


def _plain(args):
    """A one-process launch without the launcher, as launch_utils.single does it."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(L.free_port()), "OMP_NUM_THREADS": "1"}
    return {"argv": [sys.executable, *args], "environment": env}


def _manifest(root: Path) -> Path:
    pre_args = ["--set", f"checkpoint.every_steps={EVERY}", "--set", "checkpoint.keep_last=10",
                "--set", "checkpoint.packs=null", "--set", "zero.stage=1"]
    victim = _train_args("pretrain.yaml", root / "pre", STEPS, *pre_args)
    jobs = [
        {"name": "pretrain", **_plain(victim)},
        {"name": "reference", **_plain(_train_args("pretrain.yaml", root / "reference", STEPS, *pre_args))},
        {"name": "refine", "after": ["reference"], **_plain(_train_args(
            "refine.yaml", root / "refine", 2, "--init-checkpoint", str(root / "reference/checkpoints" / f"step_{STEPS:08d}")))},
        {"name": "sft", "after": ["refine"], **_plain(_train_args(
            "sft.yaml", root / "sft", 2, "--init-checkpoint", str(root / "refine/checkpoints/step_00000002"),
            "--source-stage", "refinement"))},
        # refinement brought up again once it finished, as `jobs up` after a reboot does: exit 0, followers go on
        {"name": "refine_again", "after": ["refine"], **_plain(_train_args(
            "refine.yaml", root / "refine", 2, "--init-checkpoint", str(root / "reference/checkpoints" / f"step_{STEPS:08d}")))},
        {"name": "probe", "after": ["sft", "pretrain", "refine_again"], "inherit_environment": [SECRET],
         "restart": "never",
         "directory": str(root),
         "argv": [sys.executable, "-c", "import json, os, sys; json.dump({'argv': sys.argv[1:], 'secret': "
                  f"os.environ.get('{SECRET}'), 'resume': os.environ.get('RESUME')}}, open('probe.json', 'w'))",
                  *PROBE_ARGS]},
        {"name": "idle", "restart": "always", "argv": [sys.executable, "-c", "import time; time.sleep(3600)"]},
    ]
    lines = ["version = 1", 'jobs_dir = "jobs"', f"directory = {json.dumps(str(L.REPO))}", ""]
    for job in jobs:
        lines.append("[[jobs]]")
        for key, value in job.items():
            if key == "environment":
                value = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }"
                lines.append(f"{key} = {value}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    path = root / "pipeline.toml"
    path.write_text("\n".join(lines))
    return path


def _wait(predicate, what, deadline):
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _logged_step(metrics: Path) -> int:
    """The last step with a complete row in metrics.csv (-1 before the first)."""
    try:
        text = metrics.read_text()
    except FileNotFoundError:
        return -1
    rows = text.splitlines()[1:] if text.endswith("\n") else text.splitlines()[1:-1]
    return max((int(r.split(",")[0]) for r in rows if r.split(",")[0].isdigit()), default=-1)


@pytest.fixture(scope="session")
def supervised(tmp_path_factory):
    from ds_trhash.ops import jobs
    from ds_trhash.ops.manifest import load_manifest

    root = tmp_path_factory.mktemp("supervised")
    manifest_path = _manifest(root)
    manifest = load_manifest(manifest_path)
    env = L.base_env(**{SECRET: SECRET_VALUE})
    deadline = time.monotonic() + TIMEOUT_S
    seen: dict = {"pids": set()}
    up = cli("jobs", "up", str(manifest_path), env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        server = jobs.rpc(manifest.jobs_dir)
        seen["pids"].add(server.supervisor.getPID())
        seen["second_up"] = cli("jobs", "up", str(manifest_path), env=env)
        _wait(lambda: _logged_step(root / "pre" / "metrics.csv") >= KILL_AFTER_STEP, "the victim's step", deadline)
        job_pid = server.supervisor.getProcessInfo("pretrain")["pid"]
        ranks = jobs.ranks(job_pid)
        assert len(ranks) == 1, ranks
        seen["rank_env"] = ranks[0].environ()
        seen["pids"].update(p.pid for p in jobs.process_tree(job_pid))
        seen["killed_at"] = _logged_step(root / "pre" / "metrics.csv")
        ranks[0].send_signal(signal.SIGKILL)
        seen["pids"].add(server.supervisor.getProcessInfo("idle")["pid"])
        _wait(lambda: server.supervisor.getProcessInfo("probe")["statename"] in ("EXITED", "FATAL"), "the probe job",
              deadline)
        seen["status"] = cli("jobs", "status", str(manifest_path), env=env)
        seen["infos"] = {i["name"]: i for i in server.supervisor.getAllProcessInfo()}
        seen["pids"].update(i["pid"] for i in seen["infos"].values() if i["pid"])
    finally:
        stop = cli("jobs", "stop", str(manifest_path), env=env, timeout=300)
    seen["stop"] = stop
    seen["alive_after_stop"] = [p for p in seen["pids"] if psutil.pid_exists(p)
                                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return {"root": root, "manifest": manifest, **seen}
