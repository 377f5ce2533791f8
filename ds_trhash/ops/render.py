"""Render a validated job manifest as a supervisord configuration file.

supervisord reads its file with an INI parser that treats ``;`` or ``#`` after whitespace as
a comment and ``%`` as the start of an expansion, then splits ``command`` with POSIX shell
rules (``shlex.split``) and ``environment`` with a non-POSIX lexer that strips the quote
characters around each value. The quoting below follows exactly those rules, so every argv
element and environment value reaches the process unchanged (the manifest loader refuses the
few values the format cannot hold). The output depends only on the manifest, the jobs
directory and the Python interpreter, so rendering twice gives the same bytes.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from ds_trhash.io import write_text_atomic
from ds_trhash.ops.manifest import Job, Manifest, ManifestError, looks_secret

CONFIG_NAME = "supervisord.conf"
SOCKET_NAME = "supervisor.sock"
PID_NAME = "supervisord.pid"
LOG_NAME = "supervisord.log"
LISTENER = "_after"  # the event listener that starts jobs whose `after` jobs have finished
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL
EXIT_CODES = {"training": "0,2", "command": "0"}  # 2: a user error (bad config) is not retried
AUTORESTART = {"on-failure": "unexpected", "always": "true", "never": "false"}
_COMMENT = re.compile(r"\s[;#]")


def ini_value(text: str, where: str) -> str:
    """A value the INI parser hands back unchanged: ``%`` doubled; no comment start, no edge blanks."""
    if _COMMENT.search(text) or text != text.strip():
        raise ManifestError(f"{where}: {text!r} has a ';' or '#' after whitespace, or blanks at an end, which "
                            "supervisord's configuration parser would cut; rename the path")
    return text.replace("%", "%%")


def command_word(arg: str) -> str:
    """One argv element for supervisord's ``command`` (INI line, then ``shlex.split``).

    ``shlex.quote`` handles the shell rules; ``#`` and ``;`` are written as ``\\#`` / ``\\;``
    outside the quotes so that the INI parser never sees them after whitespace."""
    parts = re.split(r"([#;])", arg)
    word = "".join("\\" + p if p in ("#", ";") else shlex.quote(p) for p in parts if p)
    return (word or "''").replace("%", "%%")


def environment_value(value: str) -> str:
    quote = '"' if '"' not in value else "'"
    return f"{quote}{value}{quote}".replace("%", "%%")


def secrets_held(manifest: Manifest) -> tuple[str, ...]:
    """Secret-looking variables some job inherits: supervisord keeps these (only) in its environment."""
    return tuple(sorted({v for j in manifest.jobs for v in j.inherit_environment if looks_secret(v)}))


def job_argv(job: Job, held: tuple[str, ...]) -> list[str]:
    """The job's argv, behind ``env -u`` for every secret held for other jobs but not named by this one."""
    drop = [v for v in held if v not in job.inherit_environment]
    return (["env", *[a for v in drop for a in ("-u", v)], "--"] if drop else []) + list(job.argv)


def _paths(out_dir: Path) -> dict[str, Path]:
    out = out_dir.resolve()
    return {"socket": out / SOCKET_NAME, "pid": out / PID_NAME, "log": out / LOG_NAME, "logs": out / "logs",
            "config": out / CONFIG_NAME}


def _program(job: Job, index: int, held: tuple[str, ...], logs: Path, file: Path) -> list[str]:
    where = f"{file}: job {job.name!r}"
    env = dict(job.environment)
    if job.kind == "training":
        env["RESUME"] = "auto"  # every (re)start continues the newest complete checkpoint
    log = job.log or logs / f"{job.name}.log"
    lines = [
        f"[program:{job.name}]",
        "command = " + " ".join(command_word(a) for a in job_argv(job, held)),
        "directory = " + ini_value(str(job.directory), f"{where}: key 'directory'"),
    ]
    if env:
        lines.append("environment = " + ",".join(f"{k}={environment_value(v)}" for k, v in sorted(env.items())))
    lines += [
        f"priority = {100 + index}",
        f"autostart = {'false' if job.after else 'true'}",
        f"autorestart = {AUTORESTART[job.restart]}",
        f"exitcodes = {EXIT_CODES[job.kind]}",
        f"startsecs = {job.start_seconds}",
        f"startretries = {job.start_retries}",
        "stopsignal = TERM",
        f"stopwaitsecs = {job.stop_wait_seconds}",
        "stopasgroup = true",
        "killasgroup = true",
        "redirect_stderr = true",
        "stdout_logfile = " + ini_value(str(log), f"{where}: key 'log'"),
        "stdout_logfile_maxbytes = 100MB",
        "stdout_logfile_backups = 5",
        "",
    ]
    return lines


def _listener(manifest: Manifest, python: str, logs: Path) -> list[str]:
    order = [f"{j.name}={','.join(j.after)}" for j in manifest.jobs if j.after]
    argv = [python, "-m", "ds_trhash.ops.after_listener", *order]
    return [
        f"[eventlistener:{LISTENER}]",
        "command = " + " ".join(command_word(a) for a in argv),
        "events = PROCESS_STATE_EXITED",
        "autorestart = true",
        "stdout_logfile = NONE",  # stdout is the event protocol
        "stderr_logfile = " + ini_value(str(logs / f"{LISTENER}.log"), "listener log"),
        "",
    ]


def render_config(manifest: Manifest, out_dir: str | os.PathLike, python: str = sys.executable) -> str:
    """The supervisord configuration text for ``manifest`` with its state under ``out_dir``."""
    p = _paths(Path(out_dir))
    if len(os.fsencode(p["socket"])) > UNIX_PATH_MAX:
        raise ManifestError(f"{manifest.path}: the jobs directory {p['socket'].parent} is too deep for a unix socket "
                            f"(the path {p['socket']} exceeds {UNIX_PATH_MAX} bytes); set a shorter jobs_dir")
    here = str(p["socket"].parent)
    sock = ini_value(str(p["socket"]), "jobs directory")
    held = secrets_held(manifest)
    lines = [
        f"; supervisord configuration rendered by `ds-trhash jobs render` from {manifest.path}".replace("%", "%%"),
        "; do not edit: change the manifest and render again",
        "",
        "[unix_http_server]",
        f"file = {sock}",
        "chmod = 0700",
        "",
        "[supervisord]",
        f"logfile = {ini_value(str(p['log']), 'jobs directory')}",
        f"pidfile = {ini_value(str(p['pid']), 'jobs directory')}",
        f"childlogdir = {ini_value(str(p['logs']), 'jobs directory')}",
        f"directory = {ini_value(here, 'jobs directory')}",
        "identifier = ds-trhash-jobs",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl = unix://{sock}",
        "",
    ]
    for index, job in enumerate(manifest.jobs):
        lines += _program(job, index, held, p["logs"], manifest.path)
    if any(j.after for j in manifest.jobs):
        lines += _listener(manifest, python, p["logs"])
    return "\n".join(lines)


def write_config(manifest: Manifest, out_dir: str | os.PathLike, python: str = sys.executable) -> Path:
    """Write ``out_dir/supervisord.conf`` atomically with mode 0600; the log folder is created too."""
    text = render_config(manifest, out_dir, python)
    p = _paths(Path(out_dir))
    p["logs"].mkdir(parents=True, exist_ok=True)
    for job in manifest.jobs:
        if job.log is not None:
            job.log.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p["config"], text, mode=0o600)
    return p["config"]
