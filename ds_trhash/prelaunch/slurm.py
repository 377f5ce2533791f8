"""`ds-trhash ops slurm`: the sbatch script of a training launch on SLURM nodes, checked, then written.

It takes the launch's own arguments (those of `deepspeed launch/train.py`) and the job's shape.
Everything that would make the job fail at once is refused before anything is written: a config
that does not load, a path it names that is missing, a global batch that does not split over
nodes x GPUs, a time limit shorter than the warning, an existing script (`--force` replaces it),
a resume that a requeued attempt could not repeat. The script itself is ``slurm_script``.

It lives with preflight and smoke, before a launch, because it reads the trainer's config and
checks; ops/ (supervised jobs) stays free of torch and of training.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ds_trhash.argtypes import nonnegative_int, positive_int
from ds_trhash.errors import UserError
from ds_trhash.prelaunch.slurm_script import MAX_LOST_NODE_REQUEUES, SlurmJob, render

WARNING_SECONDS = 300  # default: one step, one checkpoint and a margin, before the limit
SIGNAL_TIME_MAX = 65535  # the largest warning time SLURM's --signal takes
_SLURM_WORD = re.compile(r"[A-Za-z0-9_.,:@+=/-]+")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


class SlurmJobError(UserError):
    """A SLURM job that cannot be written as asked."""


def time_limit_seconds(text: str) -> int | None:
    """SLURM's --time forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in seconds; None for no limit."""
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.fullmatch(text.strip())
    if not m:
        raise SlurmJobError(f"--time {text!r} is not a SLURM time limit; write minutes, H:MM:SS or D-HH:MM:SS "
                            "(e.g. --time 24:00:00 or --time 2-00:00:00)")
    days, first, b, c = (int(g) if g is not None else None for g in m.groups())
    a = first or 0  # the pattern always has the first number
    if days is None:
        seconds = a * 60 if b is None else (a * 60 + b if c is None else a * 3600 + b * 60 + c)
    else:
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if seconds < 1:
        raise SlurmJobError(f"--time {text!r} is no time at all; give the job a time limit of at least a few minutes")
    return seconds


def _check_words(args: argparse.Namespace) -> None:
    """Values that go on #SBATCH lines: one word each, no shell or SLURM pattern characters."""
    for flag, value in (("--partition", args.partition), ("--account", args.account), ("--job-name", args.job_name)):
        if value is not None and not _SLURM_WORD.fullmatch(value):
            raise SlurmJobError(f"{flag} {value!r} is not one SLURM word; use letters, digits and _.,:@+=/-")
    for option in args.sbatch_option:
        if not option.startswith("--") or "\n" in option or "=" not in option and " " in option:
            raise SlurmJobError(f"--sbatch-option {option!r} is not an sbatch option; write it as on the sbatch "
                                "command line, e.g. --sbatch-option=--qos=high or --sbatch-option=--exclusive")


def _check_path(flag: str, path: Path) -> None:
    if re.search(r"[\s%]", str(path)):
        raise SlurmJobError(f"{flag} {path} holds a space or '%', which SLURM's #SBATCH --output line cannot take; "
                            "choose a path without them")


def _check_resume(args: argparse.Namespace) -> None:
    if args.resume not in (None, "auto"):
        raise SlurmJobError(f"--resume {args.resume}: a SLURM job always continues its own run (--resume auto), on "
                            "every attempt; to continue another run's checkpoint, resume it once into this "
                            "--output-dir by hand (--resume DIR --fork), or start from its weights with --init-checkpoint")
    if args.fork:
        raise SlurmJobError("--fork needs --resume DIR, which a SLURM job does not take (it passes --resume auto)")


def _launch_args(args: argparse.Namespace, output_dir: Path | None) -> list[str]:
    """The arguments after launch/train.py, as the job passes them on every attempt."""
    out = ["--config", args.config]
    if output_dir is not None:
        out += ["--output-dir", str(output_dir)]
    for value in args.set:
        out += ["--set", value]
    if args.max_steps is not None:
        out += ["--max-steps", str(args.max_steps)]
    if args.init_checkpoint:
        out += ["--init-checkpoint", str(Path(args.init_checkpoint).absolute())]
    if args.source_stage:
        out += ["--source-stage", args.source_stage]
    out += ["--full-parameter"] if args.full_parameter else []
    out += ["--lora-rank", str(args.lora_rank)] if args.lora_rank is not None else []
    out += ["--reshard"] if args.reshard else []
    out += ["--allow-fresh-over-damaged"] if args.allow_fresh_over_damaged else []
    return [*out, "--resume", "auto"]


def _deepspeed() -> Path:
    """The `deepspeed` launcher beside this Python (the environment the trainer is installed in)."""
    found = Path(sys.executable).parent / "deepspeed"
    if found.is_file():
        return found
    which = shutil.which("deepspeed")
    if which is None:
        raise SlurmJobError("no `deepspeed` launcher beside this Python or on PATH; install the project "
                            "(pip install -e .) in the environment the job runs in")
    return Path(which).absolute()


def check_job(args: argparse.Namespace) -> SlurmJob:
    """Every check, nothing written: the job as the script will run it."""
    from ds_trhash.training import config as tcfg
    from ds_trhash.training.entrypoint import launch_overrides

    workdir = Path.cwd()
    if not (workdir / "launch" / "train.py").is_file():
        raise SlurmJobError(f"no launch/train.py under {workdir}; run `ds-trhash ops slurm` from the repository "
                            "root (the job starts there)")
    _check_resume(args)
    _check_words(args)
    limit = time_limit_seconds(args.time) if args.time else None
    if not 1 <= args.warning_seconds <= SIGNAL_TIME_MAX:
        raise SlurmJobError(f"--warning-seconds {args.warning_seconds} is outside 1..{SIGNAL_TIME_MAX} (what SLURM's "
                            "--signal takes)")
    if limit is not None and args.warning_seconds >= limit:
        raise SlurmJobError(f"--warning-seconds {args.warning_seconds} is not shorter than the time limit --time "
                            f"{args.time} ({limit} s): the job would be warned before it started; lower it or "
                            "raise the limit")
    if args.submit and shutil.which("sbatch") is None:
        raise SlurmJobError("--submit: no `sbatch` on PATH; run this on the cluster's login node, or leave out "
                            "--submit and submit the written script there")
    output_dir = Path(args.output_dir).absolute() if args.output_dir else None
    if output_dir is not None:
        args.output_dir = str(output_dir)
    cfg = tcfg.load_config(args.config, launch_overrides(args))
    tcfg.check_paths(cfg)
    world = args.nodes * args.gpus_per_node
    try:
        layout = tcfg.batch_layout(cfg, world)
    except tcfg.ConfigError as e:  # with the nearest working choices
        raise SlurmJobError(f"--nodes {args.nodes} x --gpus-per-node {args.gpus_per_node} = {world} ranks: {e}") from None
    run_dir = Path(cfg.output_dir).absolute()
    _check_path("--output-dir", run_dir)
    script = Path(args.script).absolute() if args.script else run_dir / "slurm" / "job.sbatch"
    _check_path("--script", script)
    if script.exists() and not args.force:
        raise SlurmJobError(f"{script} exists already; nothing was written. Pass --force to replace it, or "
                            "--script FILE to write another")
    if script.is_dir():
        raise SlurmJobError(f"--script {script} is a directory; name the file to write")
    summary = (f"{cfg.stage} from {args.config} into {run_dir}\n{args.nodes} node(s) x {args.gpus_per_node} "
               f"process(es) = {world} ranks: " + (
                   f"micro-batch auto (chosen by each launch from the GPUs' memory; {layout.rows // world} rows per "
                   f"rank)" if cfg.batch.micro_batch == "auto" else
                   f"micro-batch {layout.micro_batch} x grad_accum {layout.grad_accum} x {world}")
               + f" = {layout.global_tokens:,} tokens per optimizer step")
    return SlurmJob(script=script, workdir=workdir, deepspeed=_deepspeed(), run_dir=run_dir, nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node, launch_args=_launch_args(args, output_dir),
                    job_name=args.job_name or f"trhash-{run_dir.name}", warning_seconds=args.warning_seconds,
                    time=args.time, partition=args.partition, account=args.account, cpus_per_node=args.cpus_per_node,
                    sbatch_options=list(args.sbatch_option), summary=summary,
                    max_lost_node_requeues=args.max_lost_node_requeues)


def write_script(job: SlurmJob) -> None:
    """Written whole (a temporary file renamed into place), executable."""
    job.script.parent.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "slurm").mkdir(parents=True, exist_ok=True)  # SLURM writes job-<id>.out there
    tmp = job.script.with_name(f".{job.script.name}.tmp-{os.getpid()}")
    tmp.write_text(render(job))
    tmp.chmod(0o755)
    os.replace(tmp, job.script)


def run_slurm(args: argparse.Namespace) -> int:
    job = check_job(args)
    write_script(job)
    print(f"wrote {job.script}")
    for line in job.summary.splitlines():
        print(f"  {line}")
    print(f"  logs: {job.run_dir / 'slurm'}/job-<id>.out, and per node {job.logs}/job-<id>-attempt-<n>/node-<k>.log")
    if not args.submit:
        print(f"submit it with: sbatch {job.script}")
        return 0
    done = subprocess.run(["sbatch", str(job.script)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise SlurmJobError(f"sbatch {job.script} failed (exit {done.returncode}): {done.stderr.strip()}; the script "
                            "is written: fix the cause and submit it with sbatch")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    from ds_trhash.training.entrypoint import build_arg_parser

    p = subparsers.add_parser("ops", help="training on clusters: `ops slurm` writes a SLURM batch job for a launch")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser(
        "slurm", parents=[build_arg_parser()], conflict_handler="resolve",
        help="write the sbatch script of a launch on SLURM nodes (requeued before its time limit)",
        description="Takes the arguments of `deepspeed launch/train.py` and the job's shape, checks them, and "
                    "writes an sbatch script: one deepspeed launcher per node under srun, a stop with a checkpoint "
                    "before the time limit and a requeue that continues with --resume auto (docs/operations.md).")
    s.add_argument("--nodes", type=positive_int, required=True, help="nodes of the job")
    s.add_argument("--gpus-per-node", type=positive_int, required=True,
                   help="GPUs per node, one rank each (the hostfile's slots)")
    s.add_argument("--cpus-per-node", type=positive_int,
                   help="CPUs per node for its launcher and ranks (default: whole nodes, #SBATCH --exclusive)")
    s.add_argument("--partition", help="SLURM partition (#SBATCH --partition)")
    s.add_argument("--account", help="SLURM account (#SBATCH --account)")
    s.add_argument("--time", help="time limit, SLURM's form: minutes, H:MM:SS or D-HH:MM:SS")
    s.add_argument("--warning-seconds", type=positive_int, default=WARNING_SECONDS,
                   help=f"SIGUSR1 this long before the time limit: stop after a checkpoint and requeue "
                        f"(default {WARNING_SECONDS}; more than a step plus a checkpoint write)")
    s.add_argument("--max-lost-node-requeues", type=nonnegative_int, default=MAX_LOST_NODE_REQUEUES, metavar="N",
                   help=f"after a lost rank (exit 76) requeue the job without the blamed host, at most N times "
                        f"over its attempts; 0: never (default {MAX_LOST_NODE_REQUEUES})")
    s.add_argument("--job-name", help="job name (default trhash-<output dir name>)")
    s.add_argument("--sbatch-option", action="append", default=[], metavar="--OPTION=VALUE",
                   help="another #SBATCH line, e.g. --sbatch-option=--qos=high (repeatable)")
    s.add_argument("--script", help="the file to write (default <output dir>/slurm/job.sbatch)")
    s.add_argument("--force", action="store_true", help="replace an existing script")
    s.add_argument("--submit", action="store_true", help="submit the written script with sbatch")
    s.set_defaults(func=run_slurm, error_label="ds-trhash ops slurm")
