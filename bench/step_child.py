"""Run one bench_step case in its own process and gather its result.

A case that corrupts the CUDA context (an illegal memory access poisons every later CUDA call of
the process) or dies in its cleanup must not take the other cases, or the report, with it. So
the parent starts one child per case; the child writes its result JSON as soon as the case has
run or failed, before any cleanup; the parent relays the child's output line by line and, when
no result came back (a crash, a kill, a timeout), records the error from the output's tail.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)):? ?(.*)$")
TAIL_LINES = 60


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def error_from_output(lines: list[str]) -> tuple[str | None, str]:
    """The last ``Type: message`` line of a Python traceback in ``lines`` (None when there is
    none), and the tail of the output as the traceback to record."""
    error = None
    for line in reversed(lines):
        m = _ERROR_LINE.match(line.strip())
        if m:
            error = f"{m.group(1)}: {m.group(2)}".rstrip(": ")
            break
    return error, "".join(lines[-TAIL_LINES:])


def _relay(proc: subprocess.Popen, tail: collections.deque) -> None:
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line)
    sys.stdout.flush()


def run_child(cmd: list[str], result_path: Path, timeout: float, name: str) -> dict:
    """Run ``cmd`` (a bench_step.py child for case ``name``) with ``timeout`` seconds; its result
    from ``result_path``, or a crashed/timeout record built from its output."""
    env = dict(os.environ, MASTER_PORT=free_port())  # a port of its own: no clash with the last child's
    tail: collections.deque = collections.deque(maxlen=400)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    reader = threading.Thread(target=_relay, args=(proc, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    except BaseException:  # the bench itself is stopped (SIGTERM from `timeout`, Ctrl-C): no orphan case
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    reader.join(timeout=10)
    if result_path.is_file():
        res = json.loads(result_path.read_text())
        if rc != 0:
            res["child_exit"] = rc  # the case's result came back; the process died after it (cleanup)
        return res
    error, traceback = error_from_output(list(tail))
    if timed_out:
        status, error = "timeout", f"TimeoutError: the case ran past --case-timeout {timeout:g} s" + (
            f" (last error seen: {error})" if error else "")
    else:
        status = "crashed"
        if not error:
            why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
            error = f"the case's process ended ({why}) without a result"
    return {"case": name, "status": status, "error": error, "traceback": traceback, "child_exit": rc}
