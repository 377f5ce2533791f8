"""`ds-trhash data ...`: tokenizer, shards (corpus_commands), replay plans, fingerprints, the demo corpus.

Every handler returns an exit code. Expected failures (bad input, refused overwrite,
inconsistent plans) raise a ``UserError``, which ``ds_trhash.cli`` prints as one line naming the
subcommand (exit 2); anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

from ds_trhash import outputs
from ds_trhash.errors import EXIT_USER_ERROR, UserError
from ds_trhash.io import os_errors_as, read_json_object
from ds_trhash.outputs import writes_dirs

from ds_trhash.data.plans.corpus_index import read_corpus_index
from ds_trhash.data.embedded import build_embedded
from ds_trhash.data.build.inputs import FORMATS, Skipped, decode_record, file_inputs, iter_records
from ds_trhash.data.build.tokenize import where
from ds_trhash.data.build.commands import add_corpus_commands
from ds_trhash.data.plans.plan import check_refinement, derive_refinement, load_plan, write_plan
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.plans.correct import build_corrective_plan
from ds_trhash.data.formats.tokenizer import train_tokenizer

T = TypeVar("T")


class CommandError(UserError, ValueError):
    """Arguments that argparse alone cannot reject (combinations, key=value pairs)."""


def _pairs(values: Optional[Sequence[str]], option: str, convert: Callable[[str], T]) -> Optional[dict[str, T]]:
    """Parse repeated ``source=value`` options."""
    if not values:
        return None
    out = {}
    for item in values:
        source, sep, raw = item.partition("=")
        if not sep or not source:
            raise CommandError(f"{option} expects SOURCE=VALUE, got {item!r}")
        try:
            out[source] = convert(raw)
        except ValueError:
            raise CommandError(f"{option} {item!r}: {raw!r} is not a valid {convert.__name__}") from None
    return out


def _tokenizer_texts(paths: Sequence[str], fmt: str, text_field: str) -> Iterator[object]:
    """The inputs `data tokenize` reads, for training: a text file whole (as always), the texts of
    JSONL(.gz) and Parquet records; a bad record stops it, named like `data tokenize` names it."""
    for spec in file_inputs(paths, fmt):
        if spec.fmt == "text":
            yield spec.path
            continue
        for record in iter_records([spec], text_field):
            if isinstance(record, Skipped):  # only a reader told which records are unwanted skips any
                continue
            text, bad = decode_record(record, text_field)
            if bad is not None:
                raise CommandError(f"{where(spec.label, record)}: {bad}; fix or drop that record "
                                   "(or set --text-field / --format)")
            yield text


@os_errors_as(CommandError)
def _train_tokenizer(args: argparse.Namespace) -> int:
    outputs.check_dir_target("--out", args.out)  # an existing file: say so, not "[Errno 17] File exists"
    path = train_tokenizer(_tokenizer_texts(args.input, args.format, args.text_field), args.vocab_size, args.out,
                           overwrite=args.overwrite)
    print(path)
    return 0


def _check_dataset_name(dataset: str) -> None:
    """``--dataset OWNER/NAME`` without ``hf://datasets/`` would be recorded as a local name and a
    launch with data.shards_dir null could never stream it: say which of the two was meant."""
    if "/" in dataset and not dataset.startswith("hf://"):
        raise CommandError(
            f"--dataset {dataset!r} looks like a Hub repository id but is not a URL; write "
            f"hf://datasets/{dataset} to name the Hub dataset (a launch with data.shards_dir null streams it), "
            f"or a name without '/' (e.g. {dataset.replace('/', '-')!r}) for a local corpus")


@os_errors_as(CommandError)
def _plan(args: argparse.Namespace) -> int:
    build_options = [args.manifest, args.unique_tokens, args.passes, args.weights, args.source_tokens,
                     args.dataset, args.revision, args.quality_scores]
    if args.refinement_of:
        if any(option is not None for option in build_options):
            raise CommandError("--refinement-of derives from an existing plan; drop the build options")
        doc = derive_refinement(load_plan(args.refinement_of).doc)
    else:
        missing = [name for name, value in (("--manifest", args.manifest), ("--dataset", args.dataset),
                                            ("--revision", args.revision)) if value is None]
        if args.unique_tokens is None and args.source_tokens is None:
            missing.append("--unique-tokens or --source-tokens")
        if missing:
            raise CommandError(f"building a plan needs {', '.join(missing)} (or use --refinement-of PLAN)")
        _check_dataset_name(args.dataset)
        scores = None
        if args.quality_scores:
            scores = read_json_object(args.quality_scores, CommandError,
                                      missing="--quality-scores names a JSON object from corpora/<source>/<file> to a number")
        doc = build_plan(
            read_corpus_index(args.manifest, args.seq_len),
            args.unique_tokens,
            dataset=args.dataset,
            revision=args.revision,
            source_weights=_pairs(args.weights, "--weights", float),
            source_budgets=_pairs(args.source_tokens, "--source-tokens", int),
            source_passes=_pairs(args.passes, "--passes", int),
            row_alignment=args.row_alignment,
            seq_len=args.seq_len,
            quality_scores=scores,
        )
    return _write(doc, args.out)


def _write(doc: dict, out: str) -> int:
    plan = write_plan(doc, out)
    print(f"{plan.path}: fingerprint {plan.fingerprint}, unique_tokens {plan.unique_tokens}, "
          f"trained_tokens {plan.trained_tokens}, phases {[p['name'] for p in plan.phases]}")
    return 0


@os_errors_as(CommandError)
def _correct_plan(args: argparse.Namespace) -> int:
    counts = _pairs(args.double_exposed, "--double-exposed", int)
    doc = build_corrective_plan(load_plan(args.plan), counts or {}, read_corpus_index(args.manifest))
    return _write(doc, args.out)


@os_errors_as(CommandError)
def _fingerprint(args: argparse.Namespace) -> int:
    print(load_plan(args.plan).fingerprint)
    return 0


@os_errors_as(CommandError)
def _check_refinement(args: argparse.Namespace) -> int:
    """The same rules the refinement launch applies, each one's result printed."""
    ref, pre = load_plan(args.plan), load_plan(args.pretraining)
    results = check_refinement(ref, pre)
    valid = all(r.ok for r in results)
    verdict = "valid" if valid else "refused"
    print(f"{verdict}: {ref.path} {'is' if valid else 'is not'} a refinement of {pre.path}")
    for r in results:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.rule}: {r.detail if not r.ok or r.rule == 'fingerprint' else 'holds'}")
    return 0 if valid else EXIT_USER_ERROR


@os_errors_as(CommandError)
def _embedded(args: argparse.Namespace) -> int:
    paths = build_embedded(args.out, seq_len=args.seq_len, vocab_size=args.vocab_size, seed=args.seed)
    print(json.dumps({name: str(value) for name, value in vars(paths).items()}, indent=2))
    return 0


def _add_train_tokenizer(sub: "argparse._SubParsersAction") -> None:
    """``data train-tokenizer``: it reads what ``data tokenize`` reads, so the vocabulary is learned
    from the same texts the shards are made of."""
    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE (</s>=0, <pad>=1, <s>=2, <unk>=3)")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="what `data tokenize` reads: text, JSONL, JSONL.gz or Parquet files")
    p.add_argument("--format", choices=FORMATS, default="auto", help="as for `data tokenize` (default: by suffix)")
    p.add_argument("--text-field", default="text", help="JSONL field or Parquet column of the text")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing tokenizer.json (data made with the old one no longer matches)")
    p.set_defaults(func=_train_tokenizer, error_label=p.prog)
    writes_dirs(p, "--out")


def _add_plan(sub: "argparse._SubParsersAction") -> None:
    """``data plan``: one command either builds a plan from manifests or derives a refinement plan
    from an existing one (``_plan`` refuses a mix of the two)."""
    p = sub.add_parser("plan", help="build an immutable replay plan, or derive its refinement plan")
    p.add_argument("--manifest", nargs="+", metavar="DIR_OR_FILE",
                   help="manifest.json files, source directories, or shard roots; or one corpus in the release's "
                        "layout (the directory holding mixture_manifest.json)")
    p.add_argument("--unique-tokens", type=int, help="unique token budget split by --weights")
    p.add_argument("--weights", nargs="+", metavar="SOURCE=W", help="default: proportional to available tokens")
    p.add_argument("--source-tokens", nargs="+", metavar="SOURCE=N", help="explicit per-source token budgets")
    p.add_argument("--passes", nargs="+", metavar="SOURCE=K", help="times each source is seen (default 1)")
    p.add_argument("--row-alignment", type=int, default=1)
    p.add_argument("--seq-len", type=int, help="checked against the manifests")
    p.add_argument("--dataset")
    p.add_argument("--revision")
    p.add_argument("--quality-scores", metavar="FILE",
                   help="JSON object corpora/<source>/<file> -> score: best-scored shards of each source first")
    p.add_argument("--refinement-of", metavar="PLAN", help="derive the refinement plan of a pretraining plan")
    p.add_argument("--out", required=True, metavar="PLAN.json")
    p.set_defaults(func=_plan, error_label=p.prog)


def _add_plan_tools(sub: "argparse._SubParsersAction") -> None:
    """``data correct-plan``, ``fingerprint`` and ``check-refinement``: the commands that work on a
    plan once it exists (correct it, name it, check it the way a launch does)."""
    p = sub.add_parser("correct-plan", help="replay phases without shards already trained twice (unique core kept)")
    p.add_argument("plan", metavar="PLAN", help="the uncorrected plan")
    p.add_argument("--double-exposed", nargs="+", required=True, metavar="SOURCE=N",
                   help="how many of each source's first unique-core shards were already trained twice")
    p.add_argument("--manifest", nargs="+", required=True, metavar="DIR_OR_FILE",
                   help="the corpus the plan selects from (its manifests only)")
    p.add_argument("--out", required=True, metavar="NEW.json")
    p.set_defaults(func=_correct_plan, error_label=p.prog)

    p = sub.add_parser("fingerprint", help="print a plan's unique-core fingerprint")
    p.add_argument("plan", metavar="PLAN")
    p.set_defaults(func=_fingerprint, error_label=p.prog)

    p = sub.add_parser("check-refinement", help="is PLAN a valid refinement of --pretraining? (the launch's check)")
    p.add_argument("plan", metavar="REF", help="the refinement plan")
    p.add_argument("--pretraining", required=True, metavar="PRE", help="the pretraining plan it refines")
    p.set_defaults(func=_check_refinement, error_label=p.prog)


def _add_embedded(sub: "argparse._SubParsersAction") -> None:
    """``data embedded``: the offline demo corpus, built from text every Python install has, so a
    first run needs no download."""
    p = sub.add_parser("embedded", help="build the offline demo corpus from pydoc_data.topics")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_embedded, error_label=p.prog)
    writes_dirs(p, "--out")


def register(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Add the ``data`` command group to the ``ds-trhash`` CLI, its commands in the order ``--help``
    lists them: tokenizer, corpus, plans, demo corpus."""
    data = subparsers.add_parser("data", help="pretraining data: tokenizer, token shards, replay plans, demo corpus")
    sub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    _add_train_tokenizer(sub)
    add_corpus_commands(sub, os_errors_as(CommandError))
    _add_plan(sub)
    _add_plan_tools(sub)
    _add_embedded(sub)
    return data
