"""`ds-trhash data tokenize | merge-parts | publish`: building a corpus and putting it on the Hub.

The handlers return exit codes; an expected failure raises a ``UserError``, which
``ds_trhash.cli`` prints as one line (exit 2); ``commands`` wraps them so that an OSError about a
path they were given becomes such a refusal too.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from ds_trhash.data.build.inputs import FORMATS, file_inputs, hf_input
from ds_trhash.data.build.tokenize import DEFAULT_CHUNK_RECORDS, TokenizeJob, default_workers, run_tokenize
from ds_trhash.data.build.parts import merge_parts, parse_part
from ds_trhash.data.build.publish import publish_corpus


def _tokenize(args: argparse.Namespace) -> int:
    if args.hf_dataset is not None:
        inputs = [hf_input(args.hf_dataset, args.hf_config, args.split, args.hf_revision)]
    else:
        inputs = file_inputs(args.input, args.format)
    job = TokenizeJob(
        source=args.source, inputs=inputs, tokenizer=args.tokenizer, seq_len=args.seq_len,
        rows_per_shard=args.rows_per_shard, out=Path(args.out), vocab_size=args.vocab_size,
        text_field=args.text_field, chunk_records=args.chunk_records,
        part=parse_part(args.part) if args.part else (0, 1),
        workers=args.workers or default_workers(), max_bad_records=args.max_bad_records,
    )
    run_tokenize(job)
    return 0


def _merge_parts(args: argparse.Namespace) -> int:
    merge_parts([Path(p) for p in args.parts], Path(args.out), args.max_bad_records)
    return 0


def _publish(args: argparse.Namespace) -> int:
    publish_corpus(Path(args.dir), args.target)
    return 0


def add_corpus_commands(sub: "argparse._SubParsersAction", guarded: Callable) -> None:
    """Register the three commands; ``guarded`` (``io.os_errors_as(CommandError)``) turns an
    OSError about a path a handler was given into the group's refusal."""
    p = sub.add_parser("tokenize", help="tokenize one source into uint16 shards + manifest (parallel, resumable)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--input", nargs="+", metavar="FILE", help="text, JSONL, JSONL.gz or Parquet files")
    where.add_argument("--hf-dataset", metavar="NAME",
                       help="a Hugging Face dataset (Hub name or local directory), streamed, never downloaded whole")
    p.add_argument("--hf-config", metavar="C", help="the dataset's configuration name")
    p.add_argument("--split", default="train", help="the dataset's split (default train)")
    p.add_argument("--hf-revision", metavar="REV",
                   help="the Hub dataset's branch, tag or commit; a commit makes reruns and parts read the same data")
    p.add_argument("--source", required=True, help="source name (directory and plan key)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="directory holding tokenizer.json, or the file")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--rows-per-shard", type=int, required=True)
    p.add_argument("--vocab-size", type=int, default=32000, help="model vocabulary; larger ids are errors (default 32000)")
    p.add_argument("--out", required=True, metavar="DIR", help="shard root; writes DIR/SOURCE/")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="text: one document per blank-line-separated block; auto: by suffix (.jsonl, .jsonl.gz, "
                        ".json.gz: jsonl; .parquet: parquet; else text)")
    p.add_argument("--text-field", default="text", help="JSONL field, Parquet column or dataset field of the text")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help=f"tokenizing processes (default: all cores, here {default_workers()}); the output is the same for any N")
    p.add_argument("--part", metavar="I/K", help="tokenize part I of K (from 0) into DIR/SOURCE.part-I-of-K; "
                                                 "join the K parts with `data merge-parts`")
    p.add_argument("--max-bad-records", type=int, default=0, metavar="N",
                   help="fail once more than N records are bad (invalid UTF-8, not JSON, missing or non-string "
                        "field); with --part, the part's own records (merge-parts checks the total)")
    p.add_argument("--chunk-records", type=int, default=DEFAULT_CHUNK_RECORDS, metavar="N",
                   help=f"records per unit of work and of resumption (default {DEFAULT_CHUNK_RECORDS})")
    p.set_defaults(func=guarded(_tokenize), error_label=p.prog)

    p = sub.add_parser("merge-parts", help="join the K parts of a `data tokenize --part` run into one source")
    p.add_argument("parts", nargs="+", metavar="PART_DIR", help="the SOURCE.part-I-of-K directories, all K of them")
    p.add_argument("--out", required=True, metavar="DIR", help="shard root; writes DIR/SOURCE/")
    p.add_argument("--max-bad-records", type=int, default=0, metavar="N", help="bad records allowed over all parts")
    p.set_defaults(func=guarded(_merge_parts), error_label=p.prog)

    p = sub.add_parser("publish", help="upload a corpus to a Hub dataset repository (resumable) and verify it")
    p.add_argument("dir", metavar="DIR", help="the corpus: a shard root, or the release's layout (corpora/...)")
    p.add_argument("target", metavar="hf://datasets/OWNER/REPO")
    p.set_defaults(func=guarded(_publish), error_label=p.prog)
