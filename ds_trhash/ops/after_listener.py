"""supervisord event listener that gives a manifest's ``after`` its meaning.

supervisord itself only orders start-up (``priority``); it cannot wait for a job to finish.
Jobs with ``after`` are rendered with ``autostart = false`` and this listener, run by the same
supervisord, starts each of them once every job it names has exited with status 0. A job that
exits with another status holds its followers back (its log says why; the listener's own log,
``logs/_after.log``, says which followers wait).

Arguments: ``JOB=DEP1,DEP2`` per job with ``after``. Protocol: supervisor.childutils.listener
on stdin/stdout; messages go to stderr.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from supervisor import childutils

if TYPE_CHECKING:  # the listener runs under supervisord: it imports no more than it needs
    from ds_trhash.ops.jobs import SupervisorServer


def parse_order(args: list[str]) -> dict[str, tuple[str, ...]]:
    order = {}
    for arg in args:
        job, _, deps = arg.partition("=")
        order[job] = tuple(d for d in deps.split(",") if d)
    return order


def finished(info: dict) -> bool:
    return info["statename"] == "EXITED" and info["exitstatus"] == 0


def never_started(info: dict) -> bool:
    return info["statename"] == "STOPPED" and not info["start"]


def start_ready(rpc: SupervisorServer, order: dict[str, tuple[str, ...]],
                log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[str]:
    """Start every job whose ``after`` jobs have all finished with status 0; return their names."""
    infos = {i["name"]: i for i in rpc.supervisor.getAllProcessInfo()}
    started = []
    for job, deps in order.items():
        if job not in infos or not never_started(infos[job]):
            continue
        waiting = [d for d in deps if not finished(infos[d])]
        if waiting:
            failed = [d for d in waiting if infos[d]["statename"] in ("EXITED", "FATAL")]
            if failed:
                log(f"{job} waits: {', '.join(failed)} ended without exit status 0")
            continue
        log(f"starting {job}: {', '.join(deps)} finished")
        rpc.supervisor.startProcess(job, False)
        started.append(job)
    return started


def main(argv: list[str] | None = None) -> int:
    order = parse_order(sys.argv[1:] if argv is None else argv)
    rpc = childutils.getRPCInterface(os.environ)
    while True:
        headers, _payload = childutils.listener.wait(sys.stdin, sys.stdout)
        try:
            if headers.get("eventname") == "PROCESS_STATE_EXITED":
                start_ready(rpc, order)
        except Exception as err:  # noqa: BLE001 - keep listening; the next exit event retries
            print(f"could not start followers: {err}", file=sys.stderr, flush=True)
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
