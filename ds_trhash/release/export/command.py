"""`ds-trhash export`: one checkpoint as verified SafeTensors (docs/contracts.md §9).

Registered into the single CLI with ``register(subparsers)``, apart from ``sync`` and ``cleanup``
(``release.commands``) because the exporter needs torch and they do not. User errors raise an
``ExportError``; ``ds_trhash.cli`` prints it as one line on stderr and returns 2.
"""
from __future__ import annotations

import argparse
import sys

from ds_trhash.io import os_errors_as
from ds_trhash.outputs import writes_dirs
from ds_trhash.release.export.tensors import FLOAT_DTYPES
from ds_trhash.release.export.writer import ExportError, export_checkpoint


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


def register(subparsers: argparse._SubParsersAction) -> None:
    exp = subparsers.add_parser("export", help="export a checkpoint as verified SafeTensors")
    exp.add_argument("--checkpoint", required=True, help="checkpoints/step_<N> directory")
    exp.add_argument("--out", required=True, help="new (or empty) export directory")
    exp.add_argument("--dtype", default="float32", choices=sorted(FLOAT_DTYPES))
    exp.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the one the run recorded)")
    exp.add_argument("--force-tokenizer", action="store_true",
                     help="copy --tokenizer even though its hash differs from the run's (recorded in run.json)")
    exp.set_defaults(func=run_export)
    writes_dirs(exp, "--out")
