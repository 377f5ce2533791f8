"""`ds-trhash export` and `ds-trhash sync` (`ds-trhash generate` is registered by
ds_trhash.release.generate, `ds-trhash report` by ds_trhash.report.commands).

Registered into the single CLI with ``register(subparsers)``; each subcommand sets
``func(args) -> int``. User errors raise a ``UserError``; ``ds_trhash.cli`` prints it as one line
on stderr, any token redacted, and returns 2.
"""
from __future__ import annotations

import argparse
import sys

from ds_trhash.io import os_errors_as
from ds_trhash.release import hub
from ds_trhash.release.export import FLOAT_DTYPES, ExportError, export_checkpoint
from ds_trhash.release.hub import SyncError, summary


class _RefuseToken(argparse.Action):
    """A token on the command line would land in shell history and process listings."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, "access tokens are never accepted as arguments; set HF_TOKEN in the "
                                           "environment instead (the value given was not echoed)")


@os_errors_as(ExportError)
def run_export(args: argparse.Namespace) -> int:
    manifest = export_checkpoint(args.checkpoint, args.out, args.dtype, tokenizer_dir=args.tokenizer,
                                 force_tokenizer=args.force_tokenizer)
    w = manifest["weights"]
    print(f"exported {args.checkpoint} -> {args.out}: {w['tensors']} tensors, {w['dtype']}, {w['size']} bytes, "
          f"sha256 {w['sha256']}, stage {manifest['stage']}")
    if manifest.get("tokenizer") is None:
        print("warning: no tokenizer was copied (the checkpoint records none); pass --tokenizer DIR", file=sys.stderr)
    return 0


@os_errors_as(SyncError)
def run_sync(args: argparse.Namespace) -> int:
    api = hub.make_api(require_token=not args.dry_run)  # looked up at call time (tests swap it)
    report = hub.sync(args.local, args.repo_id, api, prune_local=args.prune_local, keep_last=args.keep_last,
                      dry_run=args.dry_run, repo_type=args.repo_type, revision=args.revision,
                      lock_timeout=args.lock_timeout)
    print(summary(report))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    exp = subparsers.add_parser("export", help="export a checkpoint as verified SafeTensors")
    exp.add_argument("--checkpoint", required=True, help="checkpoints/step_<N> directory")
    exp.add_argument("--out", required=True, help="new (or empty) export directory")
    exp.add_argument("--dtype", default="float32", choices=sorted(FLOAT_DTYPES))
    exp.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the one the run recorded)")
    exp.add_argument("--force-tokenizer", action="store_true",
                     help="copy --tokenizer even though its hash differs from the run's (recorded in run.json)")
    exp.set_defaults(func=run_export)

    syn = subparsers.add_parser("sync", help="upload complete checkpoints/exports to the Hub, verify, prune")
    syn.add_argument("--local", required=True, help="run output directory, one checkpoint, or one export")
    syn.add_argument("--repo-id", required=True)
    syn.add_argument("--repo-type", default=None, choices=["model", "dataset"])
    syn.add_argument("--revision", default=None, help="branch to commit to (default main)")
    syn.add_argument("--prune-local", action="store_true",
                     help="delete local checkpoints verified on the Hub, beyond the newest --keep-last")
    syn.add_argument("--keep-last", type=int, default=1)
    syn.add_argument("--dry-run", action="store_true", help="read the Hub, upload and delete nothing")
    syn.add_argument("--lock-timeout", type=float, default=0.0,
                     help="seconds to wait for another sync's lock (default: fail at once)")
    syn.add_argument("--token", "--hf-token", nargs="?", action=_RefuseToken, help=argparse.SUPPRESS)
    syn.set_defaults(func=run_sync)


