"""Running a written SLURM script as SLURM would on its first node, with the stand-ins of
slurm_standins/ first on PATH (test_slurm_launch.py, test_slurm_lost_node.py)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import psutil

from tests.training import launch_utils as L

STANDINS = Path(__file__).parent / "slurm_standins"
NODELIST = "localhost,127.0.0.1"


def run_job(script: Path, job_id: int, record: Path, attempt: int = 0, timeout: float = 300,
            watch: Callable[[subprocess.Popen], None] | None = None, **env: str) -> dict:
    """Run the batch script; ``watch(proc)`` is called every 50 ms while it runs (to send signals).
    Every process it started is gone after. Its exit code, output, the attempt's node logs, what the
    stand-ins recorded (``scontrol requeue`` and ``update``) and the attempt's log folder."""
    env = L.base_env(PATH=f"{STANDINS}{os.pathsep}{L.VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                     SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=NODELIST, SLURM_JOB_NUM_NODES="2",
                     SLURM_NNODES="2", SLURM_RESTART_COUNT=str(attempt), SLURM_STANDIN_RECORD=str(record), **env)
    proc = subprocess.Popen(["bash", str(script)], cwd=script.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: set[psutil.Process] = set()
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the job did not end"
            try:
                seen.update(psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            if watch is not None:
                watch(proc)
            time.sleep(0.05)
        output = proc.stdout.read()
    finally:
        for p in [*seen, psutil.Process(proc.pid)] if proc.poll() is None else seen:
            if p.is_running():
                p.kill()
        proc.wait()
    folder = script.parent / "logs" / f"job-{job_id}-attempt-{attempt}"
    logs = sorted(folder.glob("node-*.log"))
    return {"code": proc.returncode, "output": output, "logs": {p.name: p.read_text() for p in logs},
            "record": record.read_text() if record.exists() else "", "folder": folder}
