"""`ds-trhash sync` (one pass or `--watch`) and `ds-trhash cleanup` (`ds-trhash export` is
registered by ds_trhash.release.export.command, `ds-trhash generate` by ds_trhash.release.generate,
`ds-trhash report` by ds_trhash.report.commands).

Nothing this module imports loads torch: a sync, each pass of a watcher (a new process every
``--every`` seconds beside a training run) and a cleanup start in a fraction of a second.

Registered into the single CLI with ``register(subparsers)``; each subcommand sets
``func(args) -> int``. User errors raise a ``UserError``; ``ds_trhash.cli`` prints it as one line
on stderr, any token redacted, and returns 2.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from ds_trhash.argtypes import nonnegative_float
from ds_trhash.io import os_errors_as
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub import watch
from ds_trhash.release.hub.sync import SyncError, summary
from ds_trhash.release.lifecycle import cleanup


class _RefuseToken(argparse.Action):
    """A token on the command line would land in shell history and process listings."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[object] | None, option_string: str | None = None) -> NoReturn:
        raise argparse.ArgumentError(self, "access tokens are never accepted as arguments; set HF_TOKEN in the "
                                           "environment instead (the value given was not echoed)")


@os_errors_as(SyncError)
def run_sync(args: argparse.Namespace) -> int:
    if (args.local is None) == (args.watch is None):
        raise SyncError("pass either --local DIR (one pass) or --watch RUN_DIR (back a run up while it trains)")
    if args.watch is not None:
        return run_watch(args)
    hub.check_repo_id(args.repo_id)  # before the token is asked for
    api = hub.make_api(require_token=not args.dry_run)  # looked up at call time (tests swap it)
    report = hub.sync(args.local, args.repo_id, api, prune_local=args.prune_local, keep_last=args.keep_last,
                      dry_run=args.dry_run, repo_type=args.repo_type, revision=args.revision,
                      lock_timeout=args.lock_timeout, path_in_repo=args.path_in_repo, incremental=args.incremental)
    print(summary(report))
    return 0


def run_watch(args: argparse.Namespace) -> int:
    if args.prune_local or args.dry_run:
        raise SyncError("--watch never prunes and always uploads: drop --prune-local / --dry-run (cleanup after "
                        "success is training.cleanup_after_success or `ds-trhash cleanup`)")
    return watch.watch(args.watch, args.repo_id, prefix=args.path_in_repo, every=args.every,
                       pass_timeout=args.pass_timeout, repo_type=args.repo_type, revision=args.revision,
                       create_repo=args.create_repo, log=lambda line: print(line, flush=True))


@os_errors_as(cleanup.CleanupRefused)
def run_cleanup(args: argparse.Namespace) -> int:
    report = cleanup.cleanup(args.run_dir, f"keep_{args.keep}", dry_run=args.dry_run,
                             lock_timeout=args.lock_timeout, log=lambda line: print(line, flush=True))
    if args.dry_run:
        print(f"cleanup {args.run_dir} (keep {args.keep}, dry run): would remove {len(report.removed)}, would keep "
              f"{len(report.kept)} numbered checkpoint(s); nothing was removed")
    else:
        print(f"cleanup {args.run_dir} (keep {args.keep}): removed {len(report.removed)}, kept {len(report.kept)} "
              "numbered checkpoint(s)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    syn = subparsers.add_parser("sync", help="upload complete checkpoints/exports to the Hub, verify, prune")
    syn.add_argument("--local", help="run output directory, one checkpoint, or one export (one pass)")
    syn.add_argument("--watch", metavar="RUN_DIR",
                     help="a run's output directory: upload its checkpoints and final/ as they appear, until the "
                          "run has finished and everything is verified")
    syn.add_argument("--repo-id", "--repo", dest="repo_id", required=True, metavar="OWNER/NAME")
    syn.add_argument("--path-in-repo", default="", metavar="PREFIX",
                     help="folder of the repository the units go under (default: its root)")
    syn.add_argument("--incremental", action="store_true",
                     help="skip units sync_verified.json records on this repository and prefix with their current "
                          "manifest (what --watch passes do)")
    syn.add_argument("--every", type=float, default=60.0, help="--watch: seconds between passes (default 60)")
    syn.add_argument("--pass-timeout", type=float, default=3600.0,
                     help="--watch: a pass still running after this many seconds is killed and retried (default 3600)")
    syn.add_argument("--create-repo", action="store_true", help="--watch: create the repository (private) if missing")
    syn.add_argument("--repo-type", default=None, choices=["model", "dataset"])
    syn.add_argument("--revision", default=None, help="branch to commit to (default main)")
    syn.add_argument("--prune-local", action="store_true",
                     help="delete local checkpoints verified on the Hub, beyond the newest --keep-last")
    syn.add_argument("--keep-last", type=int, default=1)
    syn.add_argument("--dry-run", action="store_true", help="read the Hub, upload and delete nothing")
    syn.add_argument("--lock-timeout", type=nonnegative_float, default=0.0,
                     help="seconds to wait for another sync's lock (default: fail at once)")
    syn.add_argument("--token", "--hf-token", nargs="?", action=_RefuseToken, help=argparse.SUPPRESS)
    syn.set_defaults(func=run_sync)

    cln = subparsers.add_parser("cleanup", help="delete a finished run's numbered checkpoints once final/ verifies "
                                                "(and, when the run syncs, once they are verified on the Hub)")
    cln.add_argument("run_dir", metavar="RUN_DIR", help="the training launch's --output-dir")
    cln.add_argument("--keep", choices=["packs", "final"], default="packs",
                     help="packs (default): keep token-pack and epoch checkpoints; final: keep only final/ and best/")
    cln.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    cln.add_argument("--lock-timeout", type=float, default=0.0,
                     help="seconds to wait for a sync holding the output directory's lock (default: fail at once)")
    cln.set_defaults(func=run_cleanup)

