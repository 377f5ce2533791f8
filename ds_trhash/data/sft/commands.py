"""`ds-trhash sft build` and `ds-trhash sft validate`.

Registered into the single CLI with `register(subparsers)`; each subcommand sets
`func(args) -> int` as its handler. Data errors are the user's to fix: they raise a ``UserError``,
which ``ds_trhash.cli`` prints as one clear message on stderr with exit code 2.
"""
from __future__ import annotations

import argparse

from ds_trhash.data.sft.build import SFTBuildError, build_sft_dataset, load_tokenizer_identity
from ds_trhash.data.sft.dataset import open_sft
from ds_trhash.io import os_errors_as


def _summary(counts: dict[str, dict]) -> str:
    return "\n".join(
        f"  {name}: {c['examples']} examples, {c['num_tokens']} tokens, {c['supervised_tokens']} supervised"
        for name, c in counts.items()
    )


@os_errors_as(SFTBuildError)
def run_build(args: argparse.Namespace) -> int:
    manifest = build_sft_dataset(args.input, args.eval_input, args.tokenizer, args.seq_len, args.out,
                                 drop_invalid=args.drop_invalid, source_name=args.source_name,
                                 revision=args.revision, vocab_size=args.vocab_size)
    dropped = manifest["dropped"]
    print(f"built SFT set {args.out} ({manifest['chat_template']}, seq_len {manifest['seq_len']}, vocab {manifest['vocab_size']})")
    print(_summary(manifest["partitions"]))
    if dropped["total"]:
        print(f"  dropped {dropped['total']} invalid: " + ", ".join(f"{k}={v}" for k, v in dropped["by_reason"].items()))
    return 0


@os_errors_as(SFTBuildError)
def run_validate(args: argparse.Namespace) -> int:
    tokenizer_hash = load_tokenizer_identity(args.tokenizer)[1] if args.tokenizer else None
    data = open_sft(args.dir, args.vocab_size, args.seq_len, tokenizer_hash=tokenizer_hash)
    checked = "tokenizer identity checked" if tokenizer_hash else "tokenizer identity not checked (pass --tokenizer)"
    print(f"SFT set {args.dir} is valid for vocab {args.vocab_size}, seq_len {args.seq_len}; {checked}")
    print(_summary(data.manifest["partitions"]))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    sft = subparsers.add_parser("sft", help="build and validate tokenized SFT sets")
    commands = sft.add_subparsers(dest="sft_command", required=True, metavar="{build,validate}")

    build = commands.add_parser("build", help="chat JSONL -> tokenized SFT set with a manifest")
    build.add_argument("--input", required=True, help="training conversations (JSONL, one {messages: [...]} per line)")
    build.add_argument("--eval-input", required=True, help="held-out conversations (JSONL)")
    build.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json (or the file)")
    build.add_argument("--seq-len", type=int, required=True, help="sequence cap; longer examples are errors, never truncated")
    build.add_argument("--out", required=True, help="new (or empty) output directory")
    build.add_argument("--drop-invalid", action="store_true", help="skip invalid examples and count them in the manifest")
    build.add_argument("--source-name", default=None, help="dataset name recorded per example (default: input file stem)")
    build.add_argument("--revision", default=None, help="dataset revision recorded in the manifest")
    build.add_argument("--vocab-size", type=int, default=None, help="model vocabulary (default: the tokenizer's size)")
    build.set_defaults(func=run_build)

    validate = commands.add_parser("validate", help="verify a built SFT set the way training will")
    validate.add_argument("dir", help="the SFT set directory (holding manifest.json)")
    validate.add_argument("--vocab-size", type=int, required=True, help="the model's vocabulary size")
    validate.add_argument("--seq-len", type=int, required=True, help="the training window; every example must fit")
    validate.add_argument("--tokenizer", default=None, help="the model's tokenizer directory, to check identity")
    validate.set_defaults(func=run_validate)
