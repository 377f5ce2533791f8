"""The `ds-trhash` console script: one parser, one subcommand group per concern.

Training itself is started through the DeepSpeed launcher (`deepspeed launch/train.py`), which
owns process placement; the subcommands here prepare data, run the embedded demo, and inspect
or publish results.
"""

from __future__ import annotations

import argparse
import sys

from ds_trhash import demo
from ds_trhash.data import commands as data_commands
from ds_trhash.data import sft_commands
from ds_trhash.eval import commands as eval_commands
from ds_trhash.ops import commands as ops_commands
from ds_trhash.errors import UserError
from ds_trhash.prelaunch import preflight, smoke
from ds_trhash.release import commands as release_commands
from ds_trhash.release import generate
from ds_trhash.release.hub import redact
from ds_trhash.report import commands as report_commands


def _register_all(sub) -> None:
    data_commands.register(sub)
    sft_commands.register(sub)
    eval_commands.register(sub)
    release_commands.register(sub)
    generate.register(sub)
    report_commands.register(sub)
    ops_commands.register(sub)
    demo.register(sub)
    preflight.register(sub)
    smoke.register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-trhash",
        description="DeepSpeed trainer for TR-HASH hash-routed MoE language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _register_all(sub)
    return parser


def report_user_error(exc: UserError, label: str | None = None) -> int:
    """The one place a command's refusal becomes output: ``[LABEL: ]error: <message>`` on
    stderr (any access token in it redacted), its detail lines below, and the exit code."""
    first, *details = (redact(line) for line in exc.message_lines())
    print(f"{label}: error: {first}" if label else f"error: {first}", file=sys.stderr)
    for line in details:
        print(line, file=sys.stderr)
    return exc.exit_code


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (``ds_trhash.errors.UserError``) prints one line and
    returns its exit code; any other exception is a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        # ``error_label``: the command groups whose lines name the subcommand ("ds-trhash data plan")
        return report_user_error(exc, getattr(args, "error_label", None))


if __name__ == "__main__":
    sys.exit(main())
