"""`ds-trhash jobs render|up|status|stop FILE`: supervised long-running jobs from a TOML manifest.

User errors (a bad manifest, a missing inherited variable, a supervisord already up) raise a
``UserError`` that ``ds_trhash.cli`` prints as one line (exit 2; a job that fails to start or stop,
``JobsError``, exits 1); `status` exits 3 when the manifest's supervisord is not running.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ds_trhash.io import os_errors_as
from ds_trhash.outputs import writes_dirs
from ds_trhash.ops import jobs
from ds_trhash.ops.manifest import ManifestError, load_manifest
from ds_trhash.ops.render import write_config

EXIT_NOT_RUNNING = 3


@os_errors_as(ManifestError)
def run_jobs(args: argparse.Namespace) -> int:
    manifest = load_manifest(args.manifest)
    if args.action == "render":
        print(f"wrote {write_config(manifest, Path(args.out))}")
    elif args.action == "up":
        jobs.up(manifest)
        for info in jobs.status(manifest):
            print(jobs.describe(info))
    elif args.action == "status":
        if not jobs.is_running(manifest.jobs_dir):
            print(f"supervisord for {manifest.path} is not running")
            return EXIT_NOT_RUNNING
        for info in jobs.status(manifest):
            print(jobs.describe(info))
    else:
        jobs.stop(manifest, grace=not args.now)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("jobs", help="supervised long-running jobs from a TOML manifest (supervisord)")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    render = sub.add_parser("render", help="write the supervisord configuration for a manifest")
    render.add_argument("manifest", help="job manifest (TOML, version = 1)")
    render.add_argument("--out", required=True, help="directory for supervisord.conf (and its socket, pid, logs)")
    up = sub.add_parser("up", help="start the manifest's own supervisord and its jobs")
    up.add_argument("manifest")
    st = sub.add_parser("status", help="one line per job (exit 3 when its supervisord is not running)")
    st.add_argument("manifest")
    stop = sub.add_parser("stop", help="stop every job (training jobs checkpoint first) and supervisord")
    stop.add_argument("manifest")
    stop.add_argument("--now", action="store_true",
                      help="do not ask training ranks to checkpoint first; stop the process groups at once")
    for q in (render, up, st, stop):
        q.set_defaults(func=run_jobs)
    writes_dirs(render, "--out")
