"""The checks a launch makes before it writes anything: plain functions, one job each.

The trainer calls them before any data preparation, cache directory, embedded corpus, model
or engine exists, so a refused launch changes nothing on disk. ``ds-trhash preflight`` calls
the same functions. Each raises ``LaunchCheckError`` (a user error: exit 2, one message)
naming what is wrong and how to fix it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ds_trhash import checkpoints as ckpt
from ds_trhash import outputs
from ds_trhash.checkpoints.run_source import is_run_dir, model_of_run
from ds_trhash.errors import UserError
from ds_trhash.training.preparation.request import LaunchRequest

Log = Callable[[str], None]
# Next to a run's files, the names a damaged run is set aside under (never deleted).
DAMAGED_SUFFIX = ".damaged-"


class LaunchCheckError(UserError, ValueError):
    """A launch that must not start; the message says why and what to do."""


# ----------------------------------------------------------------------------- output directory


def check_output_location(output_dir: Path) -> None:
    """A run writes checkpoints/, metrics.csv, config.json and its locks straight into its
    output directory, and a later --resume auto reads the folder as a run: the filesystem root
    or the home directory (not empty, yet holding no run) would be written among other files."""
    where = Path(output_dir).expanduser().resolve()
    if where == Path(where.anchor):
        raise LaunchCheckError(f"--output-dir {output_dir} is the filesystem root; give the run a directory of its "
                               "own, e.g. --output-dir runs/NAME")
    home = Path.home().resolve()
    if where == home:
        raise LaunchCheckError(f"--output-dir {output_dir} is the home directory {home}; give the run a directory of "
                               f"its own, e.g. --output-dir {home / 'runs' / 'NAME'}")


def check_fresh_output_dir(output_dir: Path) -> None:
    """A fresh start never writes over a run: its checkpoints and metrics would be mixed with
    the new ones. Continuing that run is an explicit --resume."""
    done = [c.name for c in ckpt.list_checkpoints(output_dir) if c.has_manifest]
    if done or (Path(output_dir) / "metrics.csv").exists():
        what = f"checkpoints {', '.join(done[-3:])}" if done else "a metrics.csv"
        raise LaunchCheckError(
            f"{output_dir} already holds a run ({what}); continue it with --resume auto, or start this "
            "launch in a new --output-dir")


def resume_auto(output_dir: Path, allow_fresh_over_damaged: bool,
                log: Log = print) -> tuple[ckpt.CheckpointInfo | None, list[tuple[str, str]]]:
    """``--resume auto``: (the newest checkpoint that verifies, the newer ones that do not) — each
    checkpoint is hashed once, newest first. The damaged newer ones are set aside
    (``set_aside_checkpoints``) once every other check passed, so the resumed run never writes
    the same step name over one of them. When checkpoints exist but none verifies the launch is
    refused, listing each and why: starting fresh would write a new run over the remains of one
    that may be repairable. ``--allow-fresh-over-damaged`` is the explicit way past; then (None,
    the damaged ones) comes back, for ``set_aside_damaged``. No checkpoint at all: (None, [])."""
    skipped: list[tuple[str, str]] = []
    for info in reversed(ckpt.list_checkpoints(output_dir)):
        ok, reason = ckpt.trusted(info.path)  # verified, and its own records agree
        if ok:
            for name, why in skipped:
                log(f"{name} is {why} — falling back to {info.name} (the damaged one is set aside before training)")
            log(f"resume auto: continuing from {info.path}")
            return info, skipped[::-1]
        skipped.append((info.name, reason))
    if not skipped:
        log(f"resume auto: no checkpoint under {ckpt.checkpoints_root(output_dir)} — starting fresh")
        return None, []
    damaged = skipped[::-1]
    if not allow_fresh_over_damaged:
        listing = "; ".join(f"{name} is {why}" for name, why in damaged)
        raise LaunchCheckError(
            f"--resume auto found checkpoints under {ckpt.checkpoints_root(output_dir)} but none verifies "
            f"({listing}); restore one, resume from a copy with --resume DIR, or pass "
            "--allow-fresh-over-damaged to set them aside and start fresh")
    return None, damaged


def check_resume_auto(output_dir: Path, allow_fresh_over_damaged: bool = False) -> list[tuple[str, str]]:
    """The refusal part of ``resume_auto`` alone (for preflight): the damaged checkpoints when
    allowed, [] when one verifies or there are none."""
    info, damaged = resume_auto(output_dir, allow_fresh_over_damaged, log=lambda _: None)
    return [] if info is not None else damaged


def _rename_aside(paths: Iterable[Path], stamp: str) -> list[Path]:
    """``<name>.damaged-<stamp>`` beside each existing path (renamed, never deleted)."""
    moved = []
    for path in paths:
        if path.exists():
            new = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{stamp}")
            os.rename(path, new)
            moved.append(new)
    return moved


def set_aside_checkpoints(output_dir: Path, names: Iterable[str], stamp: str, log: Log = print) -> list[Path]:
    """Rename the damaged checkpoints ``names`` aside: ``--resume auto`` fell back past them, and
    the resumed run will save those step names again."""
    moved = _rename_aside((ckpt.checkpoints_root(output_dir) / name for name in names), stamp)
    if moved:
        log(f"resume auto: set aside the damaged {', '.join(p.name for p in moved)} (renamed, not deleted)")
    return moved


def set_aside_damaged(output_dir: Path, stamp: str, run_files: Iterable[str], log: Log = print) -> list[Path]:
    """Rename the damaged run's checkpoints and every file ``run_files`` names (what the new run
    will write at the top of the output directory: records, config.json, final/,
    stage_complete.json, best/ ...) aside (``<name>.damaged-<stamp>``), so the fresh start
    writes nothing over the earlier run. Called only after every check passed."""
    targets = [c.path for c in ckpt.list_checkpoints(output_dir)]
    targets += [Path(output_dir) / name for name in run_files]
    moved = _rename_aside(targets, stamp)
    if moved:
        log(f"--allow-fresh-over-damaged: set aside {', '.join(p.name for p in moved)}; starting fresh")
    return moved


def check_resume_source(resume_dir: Path, output_dir: Path, fork: bool, written_in: str | None = None) -> None:
    """``--resume DIR`` continues the run that wrote DIR. Into another --output-dir that would
    be two runs claiming one history; ``--fork`` says that is meant (a new run branching off).
    ``written_in``: the output directory the checkpoint records it was saved in; a checkpoint of
    another run copied under this output directory has a local path but records the other run."""
    run_of = Path(resume_dir).resolve().parent.parent  # <run>/checkpoints/step_N
    if fork:
        return
    if run_of != Path(output_dir).resolve():
        raise LaunchCheckError(
            f"--resume {resume_dir} is a checkpoint of the run in {run_of}, not of --output-dir {output_dir}; "
            f"resume it in its own run (--output-dir {run_of}), or pass --fork to continue it as a new run here")
    if written_in and Path(written_in) != run_of:
        raise LaunchCheckError(
            f"--resume {resume_dir} was saved by the run in {written_in} and copied under --output-dir {output_dir}; "
            f"resume it in its own run (--output-dir {written_in}), or pass --fork to continue it as a new run here")


def check_flags(request: LaunchRequest) -> None:
    """Modifiers without the option they modify would be silently ignored: refuse them."""
    resume_choice = request.resume
    if request.fork and (resume_choice is None or resume_choice == "auto"):
        raise LaunchCheckError("--fork modifies --resume DIR (continue another run's checkpoint as a new run "
                               "here); pass --resume DIR with it, or drop --fork")
    if request.allow_fresh_over_damaged and resume_choice != "auto":
        raise LaunchCheckError("--allow-fresh-over-damaged modifies --resume auto (set damaged checkpoints aside "
                               "and start fresh); pass --resume auto with it, or drop it")


def check_not_own_source(output_dir: Path, init_dir: str | None, resume_dir: Path | None) -> None:
    """A launch never writes into what it reads: the --output-dir may not be, lie inside, or hold
    the --init-checkpoint, nor the run that holds it (its rotation and metrics would rewrite the
    source). ``resume_dir``: an explicit --resume DIR, which may only be read from its own run."""
    if init_dir is not None:
        outputs.refuse_overlap("--output-dir", output_dir, "--init-checkpoint", init_dir)
        run = outputs.run_holding(init_dir)
        if run is not None:
            outputs.refuse_overlap("--output-dir", output_dir, f"the run holding --init-checkpoint {init_dir},",
                                   run, fix="choose an --output-dir outside that run")
    if resume_dir is not None:
        run = outputs.run_holding(resume_dir)
        if run is None or run != Path(os.path.realpath(output_dir)):
            outputs.refuse_overlap("--output-dir", output_dir, "--resume", resume_dir)
            if run is not None:
                outputs.refuse_overlap("--output-dir", output_dir, f"the run holding --resume {resume_dir},", run,
                                       fix="resume in that run's own --output-dir, or --fork into a directory "
                                           "outside it")


def probe_writable(output_dir: Path) -> None:
    """The output directory (or the nearest existing parent) accepts a new file; the probe is
    removed again. Catches a read-only target before hours of training."""
    target = Path(output_dir)
    while not target.exists():
        target = target.parent
    probe = target / f".ds-trhash-write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as exc:
        raise LaunchCheckError(f"cannot write to {target}: {exc.strerror or exc}; choose a writable --output-dir") from None
    finally:
        with contextlib.suppress(OSError):  # never created, or already refused above
            probe.unlink()


# ----------------------------------------------------------------------------- init checkpoint


def resolve_init_checkpoint(path: str | os.PathLike | None, log: Log = print) -> str | None:
    """``--init-checkpoint`` as given: a checkpoint or export directory, or a run's output
    directory, meaning that run's final complete checkpoint (whatever the process count named
    its steps), or its ``final/`` once cleanup removed it (``checkpoints.run_source``). The
    choice is said at start."""
    if path is None:
        return None
    src = Path(path)
    if not src.exists():
        raise LaunchCheckError(f"--init-checkpoint {src} does not exist; pass a checkpoint directory "
                               "(<run>/checkpoints/step_N), an export, or a run's --output-dir")
    if not src.is_dir():
        raise LaunchCheckError(f"--init-checkpoint {src} is not a directory")
    if is_run_dir(src):
        try:
            return str(model_of_run(src, "--init-checkpoint", log))
        except ckpt.CheckpointError as exc:
            raise LaunchCheckError(str(exc)) from None
    return str(src)


# ----------------------------------------------------------------------------- identities


def check_sft_manifest_unchanged(recorded: str | None, current: str | None, sft_dir: str | None) -> None:
    """A resumed SFT run reads the same set: a set rebuilt in place (same path, new bytes)
    would silently change the data order and the examples under the saved cursor."""
    if recorded and current and recorded != current:
        raise LaunchCheckError(
            f"the SFT set {sft_dir} changed since the checkpoint: its manifest.json has sha256 {current[:12]}…, "
            f"the checkpoint recorded {recorded[:12]}…; restore that set, or start a new run with --init-checkpoint")
