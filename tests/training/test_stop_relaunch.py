"""What the user sees after Ctrl-C through the `deepspeed` launcher, and the relaunches right after.

Ctrl-C (SIGINT to the whole foreground process group) of a 2-process run: the runner returns the
prompt at once, with the status of its own KeyboardInterrupt, while the ranks still finish their
step and write the stop checkpoint. A relaunch into the folder without `--resume`, made the moment
the prompt is back, must print the refusal naming `--resume` on the console; the relaunch with
`--resume auto` then continues and ends bit-identical to the uninterrupted run. Both relaunches
wait for the stopping ranks' run lock (``DS_TRHASH_RUN_LOCK_WAIT``), so the order does not depend
on how long the stop checkpoint takes.

And the reason such a refusal was once lost: `launch.py` terminates every rank as soon as one
exits with an error, and a rank still importing torch had no handler yet, so it died silently.
The stop handlers are installed before torch is imported, which a Python audit hook checks at the
moment torch's import starts; a SIGTERM then only records a stop, and the refusal is printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS


def _args(out):
    return L.reference_run(out, micro=4)  # the 2-process reference of the resume and reshard tests


def _runner(out, extra=(), log=None, **env) -> subprocess.Popen:
    port = L.free_port()
    cmd = [str(L.VENV_BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
           str(L.REPO / "launch" / "train.py"), *_args(out), *extra]
    sink = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115  (closed by the caller's communicate)
    return subprocess.Popen(cmd, cwd=L.REPO, env=L.base_env(**env), stdout=sink, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _rows(out) -> int:
    try:
        return len(L.metrics(out))
    except (OSError, ValueError):
        return 0


def _finish(proc: subprocess.Popen, timeout=600) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out or ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_ctrl_c_then_a_relaunch_is_refused_naming_resume_and_resume_auto_is_bit_identical(shared_launches, tmp_path):
    ref = shared_launches.get(2, _args)  # read only
    out = tmp_path / "run"
    first = _runner(out, log=tmp_path / "first.log")
    try:
        while _rows(out) < 2:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        code = first.wait(timeout=120)  # the prompt is back
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    # shell status 130 (the runner's KeyboardInterrupt), or launch.py's 1 from a runner started with SIGINT ignored
    assert code in (-signal.SIGINT, 1), code
    wait = {"DS_TRHASH_RUN_LOCK_WAIT": "300"}  # the stopping ranks may still hold the run lock
    console = _finish(_runner(out, **wait))
    assert "error: " in console and "already holds a run" in console and "--resume auto" in console, console[-4000:]
    assert "Traceback" not in console, console[-4000:]
    resumed = _runner(out, ["--resume", "auto"], **wait)
    console = _finish(resumed)
    assert resumed.returncode == 0, console[-6000:]
    stopped = (tmp_path / "first.log").read_text()
    assert stopped.count("stopped at step") == 2, stopped[-4000:]  # both ranks wrote their stop
    assert "resuming at step" in console
    last = f"checkpoints/step_{STEPS:08d}"
    L.assert_identical(L.model_weights(out / last), L.model_weights(ref / last))
    assert (out / "expert_load.csv").read_text() == (ref / "expert_load.csv").read_text()


AUDIT = """\
import runpy, signal, sys
def hook(event, args):
    if event == "import" and args[0] == "torch" and not hook.seen:
        hook.seen = True
        ours = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        sys.stderr.write(f"torch import starts; SIGTERM handled: {ours}\\n")
        sys.stderr.flush()
hook.seen = False
sys.addaudithook(hook)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _sigterm_caught(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_a_rank_terminated_while_it_imports_still_prints_its_refusal(tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "metrics.csv").write_text("step,train_loss\n1,9.0\n")  # a run is there: a fresh launch is refused
    env = L.base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(L.free_port()))
    proc = subprocess.Popen([sys.executable, "-c", AUDIT, str(L.REPO / "launch" / "train.py"), *_args(out)],
                            cwd=L.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not _sigterm_caught(proc.pid):  # the handler is in place: as launch.py would, terminate it
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "torch import starts; SIGTERM handled: True" in stderr, stderr[-4000:]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{stderr[-4000:]}"
    assert f"error: {out} already holds a run (a metrics.csv); continue it with --resume auto" in stderr, stderr[-4000:]
