"""`ds-trhash report`: the run record of one run, or a report directory over several stages.

``--out`` ending in ``.json`` with one ``--run`` keeps the original form (run_record.json and
run_record.md beside it); several runs or any other ``--out`` write a directory with
index.html, plots/ and records/ (ds_trhash.report.index). User errors raise (``ds_trhash.cli`` prints them, exit 2).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ds_trhash import outputs
from ds_trhash.io import os_errors_as
from ds_trhash.release.record.writer import RecordError, is_run_record, write_run_record
from ds_trhash.report.index import is_directory_output, write_report


@os_errors_as(RecordError)
def run_report(args: argparse.Namespace) -> int:
    fields = {"selection_rule": args.selection_rule, "selected_checkpoint": args.selected_checkpoint,
              "known_limitations": args.limitation or None}
    directory = is_directory_output(args.out, len(args.run))
    for run in args.run:  # a report describes runs; it never writes into one's files or folders
        if not directory and _in_top_folder(args.out, run):
            continue  # run_record.json/.md beside the run's own files: new names, nothing it reads
        outputs.refuse_overlap("--out", args.out, "--run", run, may_hold=True,
                               fix="write the report outside the run directory, or the record as "
                                   "RUN/run_record.json")
    outputs.check_dir_target("--out", args.out if directory else Path(args.out).parent)
    if directory:
        out = Path(args.out)
        index = write_report([Path(r) for r in args.run], out, last_fields=fields,
                             export_dir=Path(args.export) if args.export else None)
        print(f"wrote {index} (plots in {out / 'plots'}, run records in {out / 'records'})")
        return 0
    doc = write_run_record(args.out, run_dir=args.run[0], export_dir=args.export, **fields)
    print(f"wrote {args.out} (and run_record.md beside it); unknown: {', '.join(doc['unknown']) or 'none'}")
    return 0


def _in_top_folder(out: str, run: str) -> bool:
    """``--out RUN/NAME.json``: a record in the run's top folder, under a name that is new there or
    holds an earlier run record. Writing it (and run_record.md beside it) changes no file the run
    wrote or a later command reads, so it is accepted where the docs put it."""
    target = Path(out)
    if outputs.relation(target.parent, run) != "is":
        return False
    return not (target.exists() or target.is_symlink()) or is_run_record(target)


def register(subparsers: argparse._SubParsersAction) -> None:
    rep = subparsers.add_parser("report", help="write the run record (JSON + Markdown), or a report directory "
                                               "with plots and index.html")
    rep.add_argument("--run", required=True, action="append",
                     help="run output directory; repeat for several stages, in order (pretraining first)")
    rep.add_argument("--out", required=True,
                     help="OUT.json: the run record of one run; any other OUT (or several --run): a report "
                          "directory with index.html, plots/ and records/")
    rep.add_argument("--export", default=None, help="export directory (for the SafeTensors hash; last --run)")
    rep.add_argument("--selection-rule", default=None,
                     help="'last' or 'min_eval_loss' (computed), or your own rule text with --selected-checkpoint")
    rep.add_argument("--selected-checkpoint", default=None)
    rep.add_argument("--limitation", action="append", default=[], help="a known limitation (repeatable)")
    rep.set_defaults(func=run_report)
