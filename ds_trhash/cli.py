"""The `ds-trhash` console script: one parser, one subcommand group per concern.

Training itself is started through the DeepSpeed launcher (`deepspeed launch/train.py`), which
owns process placement; the subcommands here prepare data, run the embedded demo, and inspect
or publish results.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ds_trhash import outputs
from ds_trhash.errors import UserError
from ds_trhash.release.hub.client import redact

# The module that registers each command (``register(subparsers)``), in the order help lists them.
# A command line imports only its own command's module: `ds-trhash jobs status` or `ds-trhash
# data fingerprint` starts without torch. Help, or a name that is no command, registers them all.
COMMANDS = {
    "data": "ds_trhash.data.commands",
    "sft": "ds_trhash.data.sft.commands",
    "eval": "ds_trhash.eval.commands",
    "export": "ds_trhash.release.export.command",
    "sync": "ds_trhash.release.commands",
    "cleanup": "ds_trhash.release.commands",
    "generate": "ds_trhash.release.generate",
    "report": "ds_trhash.report.commands",
    "jobs": "ds_trhash.ops.commands",
    "ops": "ds_trhash.prelaunch.slurm",
    "demo": "ds_trhash.demo",
    "preflight": "ds_trhash.prelaunch.preflight",
    "smoke": "ds_trhash.prelaunch.smoke",
    "model": "ds_trhash.prelaunch.model_size",
}


def _register(sub: argparse._SubParsersAction, argv: list[str] | None) -> None:
    """Register the module of the command ``argv`` names, or every module when it names none (the
    top level has no option but --help, so a command is always the first argument)."""
    command = argv[0] if argv else None
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(sub)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or (given the command line ``argv``) of the one it names."""
    parser = argparse.ArgumentParser(
        prog="ds-trhash",
        description="DeepSpeed trainer for TR-HASH hash-routed MoE language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _register(sub, argv)
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
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        outputs.check_declared(args)  # an output folder that is a file: refused naming its option
        return int(args.func(args) or 0)
    except UserError as exc:
        # ``error_label``: the command groups whose lines name the subcommand ("ds-trhash data plan")
        return report_user_error(exc, getattr(args, "error_label", None))


if __name__ == "__main__":
    sys.exit(main())
