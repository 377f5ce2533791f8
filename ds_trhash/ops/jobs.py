"""Start, inspect and stop the supervisord that runs one job manifest.

Each manifest gets its own supervisord, with its unix socket, pid file, configuration and logs
in the manifest's jobs directory, so several manifests (or several users) never share one.
Everything talks to it through supervisor's XML-RPC interface over that socket.

Stopping is gentle for training jobs: the ranks (the processes of the job that carry ``RANK``
in their environment) get one SIGTERM, finish their step, write a checkpoint and exit 0, which
supervisord treats as a normal end. Signalling the whole process group instead would reach the
deepspeed launcher too, which then terminates each rank's process tree in turn and SIGKILLs a
rank still running after its grace period: a rank in a long step or save would die without its
checkpoint. (The trainer itself only records signals, a second SIGTERM included; the stop
lands at the next step boundary.)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import xmlrpc.client
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import psutil
from supervisor.xmlrpc import SupervisorTransport

from ds_trhash.errors import UserError
from ds_trhash.ops.manifest import Manifest, ManifestError, looks_secret
from ds_trhash.ops.render import LISTENER, PID_NAME, SOCKET_NAME, secrets_held, write_config

Log = Callable[[str], None]
START_TIMEOUT_S = 30.0


class JobsError(UserError, RuntimeError):
    """supervisord did not do what was asked (did not start, did not stop everything, answered
    a call with a fault): the jobs failed rather than the manifest, so exit status 1."""

    exit_code = 1


@contextlib.contextmanager
def answering(jobs_dir: Path) -> Iterator[None]:
    """Calls to the manifest's supervisord: a fault or a broken answer becomes a JobsError."""
    try:
        yield
    except xmlrpc.client.Error as exc:
        raise JobsError(f"supervisord on {Path(jobs_dir) / SOCKET_NAME}: {exc}") from exc


ProcessInfo = dict[str, Any]  # supervisord's getProcessInfo struct: name, statename (str), pid (int), ...


class Supervisor(Protocol):
    """The calls of supervisord's XML-RPC ``supervisor`` namespace this module makes, with the
    types of their answers (``ServerProxy`` types every answer as any XML-RPC value)."""

    def getState(self) -> dict[str, object]: ...
    def getPID(self) -> int: ...
    def getProcessInfo(self, name: str) -> ProcessInfo: ...
    def getAllProcessInfo(self) -> list[ProcessInfo]: ...
    def startProcess(self, name: str, wait: bool) -> bool: ...
    def stopProcessGroup(self, name: str, wait: bool) -> object: ...
    def stopAllProcesses(self, wait: bool) -> object: ...
    def shutdown(self) -> bool: ...


class SupervisorServer(Protocol):
    supervisor: Supervisor


def rpc(jobs_dir: Path) -> SupervisorServer:
    transport = SupervisorTransport(None, None, f"unix://{Path(jobs_dir) / SOCKET_NAME}")
    return cast(SupervisorServer, xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport))


def is_running(jobs_dir: Path) -> bool:
    if not (Path(jobs_dir) / SOCKET_NAME).exists():
        return False
    try:
        return rpc(jobs_dir).supervisor.getState()["statename"] == "RUNNING"
    except (OSError, xmlrpc.client.Error):
        return False


def supervisord_environment(manifest: Manifest, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment supervisord (and so every job) starts from: the caller's, without any
    secret-looking variable except those a job names in ``inherit_environment``. Jobs that do
    not name one are started behind ``env -u`` (see render.job_argv)."""
    missing = [(j.name, v) for j in manifest.jobs for v in j.inherit_environment if v not in environ]
    if missing:
        job, var = missing[0]
        raise ManifestError(f"{manifest.path}: job {job!r}: key 'inherit_environment': {var} is not set in the "
                            f"environment of `ds-trhash jobs up`; export it first")
    held = set(secrets_held(manifest))
    return {k: v for k, v in environ.items() if not looks_secret(k) or k in held}


def up(manifest: Manifest, environ: Mapping[str, str] | None = None, log: Log = print) -> Path:
    """Render the configuration into the jobs directory and start supervisord on it."""
    jobs_dir = manifest.jobs_dir
    if is_running(jobs_dir):
        raise ManifestError(f"{manifest.path}: its supervisord is already running ({jobs_dir / SOCKET_NAME}); "
                            "see `ds-trhash jobs status`, or `ds-trhash jobs stop` first")
    env = supervisord_environment(manifest, os.environ if environ is None else environ)
    jobs_dir.mkdir(parents=True, exist_ok=True)
    config = write_config(manifest, jobs_dir)
    proc = subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(config)], env=env,
                          capture_output=True, text=True, timeout=START_TIMEOUT_S)
    if proc.returncode != 0:
        raise JobsError(f"supervisord did not start (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not is_running(jobs_dir):
        if time.monotonic() > deadline:
            raise JobsError(f"supervisord did not answer on {jobs_dir / SOCKET_NAME} within {START_TIMEOUT_S:.0f} s; "
                            f"see {jobs_dir / 'supervisord.log'}")
        time.sleep(0.1)
    with answering(jobs_dir):
        log(f"supervisord running (pid {rpc(jobs_dir).supervisor.getPID()}), configuration {config}")
    return config


def status(manifest: Manifest) -> list[ProcessInfo]:
    """supervisor's process info for every job of the manifest, in manifest order."""
    with answering(manifest.jobs_dir):
        infos = {i["name"]: i for i in rpc(manifest.jobs_dir).supervisor.getAllProcessInfo()}
    return [infos[j.name] for j in manifest.jobs if j.name in infos]


def describe(info: Mapping) -> str:
    return f"{info['name']:<24} {info['statename']:<9} {info['description']}"


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def ranks(pid: int) -> list[psutil.Process]:
    """The training processes below a job's pid: those started with RANK in their environment."""
    out = []
    for proc in process_tree(pid):
        try:
            if "RANK" in proc.environ():
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _wait_stopped(server: SupervisorServer, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.supervisor.getProcessInfo(name)["statename"] not in ("RUNNING", "STARTING", "STOPPING"):
            return True
        time.sleep(0.2)
    return False


def stop(manifest: Manifest, log: Log = print, grace: bool = True) -> None:
    """Stop every job (training jobs gently first), shut supervisord down, and check that no
    process of theirs is left; JobsError names any survivor (after killing it)."""
    jobs_dir = manifest.jobs_dir
    if not is_running(jobs_dir):
        log(f"supervisord for {manifest.path} is not running")
        return
    with answering(jobs_dir):
        _stop(manifest, jobs_dir, log, grace)


def _stop(manifest: Manifest, jobs_dir: Path, log: Log, grace: bool) -> None:
    server = rpc(jobs_dir)
    watched = process_tree(server.supervisor.getPID())
    infos = {i["name"]: i for i in server.supervisor.getAllProcessInfo()}
    if LISTENER in infos:  # no follower may start because a job ended on our signal
        server.supervisor.stopProcessGroup(LISTENER, True)
    for job in manifest.jobs:
        info = infos.get(job.name)
        if not (grace and job.kind == "training" and info and info["statename"] == "RUNNING"):
            continue
        targets = ranks(info["pid"])
        for proc in targets:
            proc.send_signal(signal.SIGTERM)
        if targets:
            log(f"{job.name}: SIGTERM to {len(targets)} rank(s); waiting up to {job.stop_wait_seconds} s for "
                "the step to finish and the checkpoint to be written")
            _wait_stopped(server, job.name, job.stop_wait_seconds)
    server.supervisor.stopAllProcesses(True)
    server.supervisor.shutdown()
    gone, alive = psutil.wait_procs(watched, timeout=30)
    if alive:
        for proc in alive:
            proc.kill()
        raise JobsError("processes still alive after supervisord shut down (killed now): "
                        + ", ".join(str(p.pid) for p in alive))
    (jobs_dir / PID_NAME).unlink(missing_ok=True)
    log(f"supervisord for {manifest.path} stopped; no job process is left")
