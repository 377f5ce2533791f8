"""Why a relaunch's refusal was once lost, and the check that keeps it printed.

`launch.py` terminates every rank as soon as one exits with an error, and a rank still importing
torch had no handler yet, so it died silently instead of printing why it refused. The stop
handlers are installed before torch is imported, which a Python audit hook checks at the moment
torch's import starts; a SIGTERM then only records a stop, and the refusal is printed.

What the user sees after Ctrl-C through the `deepspeed` launcher, and the relaunch right after it
(refused naming --resume auto, the moment the prompt is back), is in
tests/training/test_stop_signals.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

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
    proc = subprocess.Popen([sys.executable, "-c", AUDIT, str(L.REPO / "launch" / "train.py"), *L.reference_run(out, micro=4)],
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
