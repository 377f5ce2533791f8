"""Where a command may write: checks on an output path made before anything is written.

Every command that writes a directory (a launch's ``--output-dir``, ``export --out``, ``sft build
--out``, ``report --out``, the demo, smoke and preflight folders) refuses here, naming both paths,
when the output would land in, on or around what it reads (a launch over its own
``--init-checkpoint`` would leave that checkpoint corrupt), when the output names a regular file
or lies below one, or when a convenience command would write over files it did not make. A
``ds-trhash`` command declares the options that name a folder it writes (``writes_dirs``), and
the console script checks each of them before the command runs (``check_declared``). It
imports only the standard library and the error base, so any package can use it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ds_trhash.errors import UserError

PathLike = str | os.PathLike


class OutputPathError(UserError, ValueError):
    """An output path that would overwrite an input, or cannot be a directory."""


def _real(path: PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def relation(out: PathLike, src: PathLike) -> str | None:
    """How ``out`` lies against ``src`` (symlinks followed): "is", "is inside", "holds", or None."""
    a, b = _real(out), _real(src)
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    if a in b.parents:
        return "holds"
    return None


def refuse_overlap(out_flag: str, out: PathLike, src_flag: str, src: PathLike, fix: str = "",
                   may_hold: bool = False) -> None:
    """Refuse an output that is, lies inside, or holds an input: writing it would change the input.
    ``may_hold``: an output that only adds new entries beside the input (a report folder) may hold it."""
    how = relation(out, src)
    if how is not None and not (may_hold and how == "holds"):
        raise OutputPathError(
            f"{out_flag} {out} {how} {src_flag} {src}; writing there would change what this command reads: "
            + (fix or f"choose an {out_flag} outside {src}"))


def run_holding(checkpoint: PathLike) -> Path | None:
    """The run directory a checkpoint belongs to: ``<run>/checkpoints/step_N`` or a run's
    selected ``<run>/best``; None for a checkpoint or export outside any run."""
    path = _real(checkpoint)
    if path.parent.name == "checkpoints":
        return path.parent.parent
    if (path.parent / "checkpoints").is_dir():
        return path.parent
    return None


def check_dir_target(flag: str, path: PathLike) -> None:
    """An output directory cannot be a regular file, nor lie below one (say so, not ``[Errno 20]``)."""
    target = Path(path)
    if os.fspath(path) == "":
        raise OutputPathError(f"{flag} is empty; pass a directory path")
    for candidate in (target, *target.parents):
        if candidate.exists() or candidate.is_symlink():
            if not candidate.is_dir():
                where = "is a regular file" if candidate == target else f"lies below the regular file {candidate}"
                raise OutputPathError(f"{flag} {path} {where}, not a directory; choose a directory path")
            return


# The argparse default under which a command declares the options that name a folder it writes.
DIR_OPTIONS = "dir_options"


def writes_dirs(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Declare that ``parser``'s command writes a folder at each option in ``flags`` ("--out"):
    ``ds-trhash`` checks every declared one (``check_declared``) before the command runs."""
    parser.set_defaults(**{DIR_OPTIONS: tuple(flags)})


def check_declared(args: argparse.Namespace) -> None:
    """The one check of every folder a ``ds-trhash`` command writes: an option declared with
    ``writes_dirs`` that names a regular file (or a path below one) is refused naming the option,
    before the command reads or writes anything."""
    for flag in getattr(args, DIR_OPTIONS, ()):
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            check_dir_target(flag, value)


def is_empty_or_absent(path: PathLike) -> bool:
    """True for a path that does not exist or is an empty directory."""
    p = Path(path)
    return not p.exists() or (p.is_dir() and not any(p.iterdir()))


def refuse_unless_ours(flag: str, path: PathLike, ours: bool, what: str) -> None:
    """A convenience command writes only into a directory it created itself (``ours``: its own
    marker is there) or an empty/new one; anything else was made by someone and stays untouched."""
    check_dir_target(flag, path)
    if not ours and not is_empty_or_absent(path):
        raise OutputPathError(
            f"{flag} {path} is not empty and was not made by {what}; it is left untouched: "
            f"move it away or choose a new {flag}")
