"""`ds-trhash smoke`: the stage at its real size for a few steps, end to end, with a projection.

Before a run of days, run its config for ``--steps`` optimizer steps (on the first rows of the
plan, or the first packs of the SFT set) through the real ``deepspeed`` launcher into a scratch
directory, and go through everything the long run will do once:

1. train   -- steps 1..N, checkpoints at N/2 and N (every step logged)
2. save    -- the step-N checkpoint verifies; its size and the time its save took
3. resume  -- the step-N checkpoint is moved aside and ``--resume auto`` trains N/2..N again;
              the weights are compared with the uninterrupted ones
4. evaluate-- held-out loss of the final checkpoint (SFT: ``ds-trhash eval heldout`` on the SFT
              set; pretraining: the plan rows that follow the trained ones)
5. export  -- ``ds-trhash export`` of the final checkpoint (verified round trip)

and report step time, tokens/s, peak memory, checkpoint size and save time, and the full
run's projected wall time (steps x step time + saves x save time) and disk (checkpoints kept at
once x checkpoint size). Any failure stops the smoke with the step's name and exit 1 (2 when
the launch refused its arguments). The scratch directory is removed on success unless
``--keep``; after a failure it is kept for its logs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash import outputs
from ds_trhash.checkpoints.weights import load_weights_only
from ds_trhash.argtypes import positive_float, positive_int
from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.errors import EXIT_USER_ERROR, UserError
from ds_trhash.eval import commands as eval_commands
from ds_trhash.eval.commands import load_model
from ds_trhash.io import os_errors_as
from ds_trhash.eval.heldout import heldout_loss
from ds_trhash.prelaunch import smoke_figures as fig
from ds_trhash.prelaunch.data_check import resolve_stage_data
from ds_trhash.release.export import command as export_command
from ds_trhash.training import config as tcfg
from ds_trhash.training.checkpoint_plan import CheckpointPlan
from ds_trhash.training.display import format_duration
from ds_trhash.deepspeed_command import deepspeed_command
from ds_trhash.training.memory import auto as auto_micro_batch
from ds_trhash.training.preparation.footprint import estimate, gib
from ds_trhash.training.preparation.resources import default_nproc, probe_devices
from ds_trhash.training.entrypoint import build_arg_parser, config_from_args

EXIT_FAILED = 1  # a step of the smoke failed (a refusal of its own arguments exits EXIT_USER_ERROR)
OWNED = (("output_dir", "--output-dir"), ("resume", "--resume"), ("max_steps", "--max-steps"))


class SmokeArgumentError(UserError, ValueError):
    """Arguments the smoke cannot take (it chooses them itself, or they leave nothing to resume)."""


class StepFailed(UserError, RuntimeError):
    """A step of the smoke failed: exit 1, or 2 when the launch refused its arguments."""

    def __init__(self, step: str, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.step, self.exit_code = step, code


def _say(step: str, text: str) -> None:
    print(f"smoke {step:<9} {text}", flush=True)


def _passthrough(args: argparse.Namespace) -> list[str]:
    """The launch arguments the smoke forwards unchanged."""
    out: list[str] = []
    for item in args.set:
        out += ["--set", item]
    if args.init_checkpoint:
        out += ["--init-checkpoint", str(Path(args.init_checkpoint).resolve())]
    if args.source_stage:
        out += ["--source-stage", args.source_stage]
    if args.full_parameter:
        out.append("--full-parameter")
    if args.lora_rank is not None:
        out += ["--lora-rank", str(args.lora_rank)]
    return out


def _launch(step: str, argv: list[str], log: Path, timeout: float) -> None:
    """One deepspeed launch, its own process group (killed whole on timeout), output to ``log``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("RESUME", "DS_TRHASH_FAULT"):
        env.pop(name, None)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise StepFailed(step, f"the launch did not finish within {timeout:.0f} s (killed); log: {log}") from None
        except BaseException:  # Ctrl-C: no rank outlives the smoke
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-15:])
        raise StepFailed(step, f"the launch exited {code}; last lines of {log}:\n{tail}",
                         EXIT_USER_ERROR if code == EXIT_USER_ERROR else EXIT_FAILED)


def _weights_equal(a: Path, b: Path) -> tuple[bool, str]:
    wa, wb = load_weights_only(a)[0], load_weights_only(b)[0]
    if wa.keys() != wb.keys():
        return False, f"different tensor names ({sorted(set(wa) ^ set(wb))[:3]})"
    diff = [k for k in wa if not torch.equal(wa[k], wb[k])]
    if not diff:
        return True, f"all {len(wa)} tensors bit-identical to the uninterrupted run"
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in diff)
    return False, f"{len(diff)} of {len(wa)} tensors differ from the uninterrupted run (max |delta| {worst:.3g})"


def _command(register: Callable[[argparse._SubParsersAction], object], argv: list[str]) -> int:
    """A ``ds-trhash`` subcommand in this process: its own ``register`` and handler. A refusal
    it raises propagates (the smoke reports it as the failed step)."""
    parser = argparse.ArgumentParser(prog="ds-trhash")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _evaluate(cfg: tcfg.TrainConfig, ckpt: Path, workdir: Path, world: int, batches: int) -> tuple[float, str]:
    state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
    out = workdir / "eval.json"
    if cfg.data.kind == "sft":
        code = _command(eval_commands.register, [
            "eval", "heldout", "--checkpoint", str(ckpt), "--sft-dir", state["sft_dir"], "--out", str(out),
            "--seq-len", str(cfg.data.seq_len), "--micro-batch", str(cfg.batch.micro_batch),
            "--policy", cfg.data.packing.policy])
        if code:  # a refusal raises (and fails the step with its message); this is any other exit
            raise StepFailed("evaluate", f"ds-trhash eval heldout exited {code}")
        result = json.loads(out.read_text(encoding="utf-8"))
        return result["eval_loss"], f"held-out loss over the SFT eval set ({result['eval_tokens']:,} tokens)"
    return _plan_rows_loss(cfg, ckpt, workdir, state, world, batches)


def _plan_rows_loss(cfg: tcfg.TrainConfig, ckpt: Path, workdir: Path, state: dict, world: int, batches: int) -> tuple[float, str]:
    """Loss on the plan rows after the trained ones (not seen yet), one process."""
    data, _ = resolve_stage_data(cfg, world, deep=False, scratch=workdir)
    if data.plan is None:  # a pretraining stage's data has its plan
        raise RuntimeError("pretraining data came without its plan")
    reader = ReplayReader(data.plan, data.shards_dir, cfg.seed)
    layout = BatchLayout(tcfg.micro_batch(cfg), grad_accum=1, rank=0, world_size=1)
    per_step = layout.global_batch  # the reader's steps here: one process, one micro-batch each
    first = int(state["data_cursor"]) // per_step  # step index of the next unseen rows
    last = reader.num_rows // per_step
    which = "after the trained ones" if first < last else "trained last (the smoke covered the whole plan)"
    first = min(first, max(0, last - batches))
    idx = range(first, min(last, first + batches))
    model, _config, _source, _ = load_model(ckpt)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = ({"input_ids": x, "labels": y} for x, y in (reader.batch(s, 0, layout) for s in idx))
    result = heldout_loss(model.to(device), rows, device)
    return result["eval_loss"], f"loss on {len(idx) * per_step} plan rows {which} ({result['eval_tokens']:,} tokens)"


# ----------------------------------------------------------------------------- the run


def _step_train(argv: list[str], n: int, run_dir: Path, final: Path, workdir: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    _launch("train", argv, workdir / "logs" / "train.log", timeout)
    step_s, tokens, which = fig.typical_step(fig.step_seconds(run_dir / "metrics.csv"))
    peak, kind = fig.peak_memory(final)
    _say("train", f"{n} steps: {step_s:.3f} s per step ({which}), {tokens / step_s:,.0f} tokens/s, "
                  f"peak memory {gib(peak)} ({kind})")
    return {"seconds": time.perf_counter() - t0, "step_seconds": step_s, "tokens_per_step": tokens,
            "tokens_per_second": tokens / step_s, "peak_memory_bytes": peak, "peak_memory_kind": kind}


def _step_save(cfg: tcfg.TrainConfig, world: int, final: Path) -> dict:
    try:
        ok, why = ckpt.verify(final)
        if not ok:
            raise fig.FiguresError(f"{final.name} is {why}")
        size, save_s = fig.directory_bytes(final), fig.save_seconds(final)
    except (OSError, fig.FiguresError) as exc:
        raise StepFailed("save", str(exc)) from None
    predicted = estimate(cfg, tcfg.model_config(cfg), world, probe_devices().kind)
    _say("save", f"{final.name}: {gib(size)} in {save_s:.2f} s (estimated {gib(predicted.checkpoint)})")
    return {"checkpoint_bytes": size, "save_seconds": save_s, "estimated_checkpoint_bytes": predicted.checkpoint}


def _step_resume(argv: list[str], half: int, n: int, final: Path, workdir: Path, timeout: float) -> dict:
    aside = workdir / f"uninterrupted_{final.name}"
    os.replace(final, aside)
    t0 = time.perf_counter()
    _launch("resume", argv + ["--resume", "auto"], workdir / "logs" / "resume.log", timeout)
    if not ckpt.verify(final)[0]:
        raise StepFailed("resume", f"the resumed launch left no complete {final.name}")
    same, how = _weights_equal(aside, final)
    _say("resume", f"step {half} -> {n}: {how}")
    return {"from_step": half, "to_step": n, "seconds": time.perf_counter() - t0, "identical": same}


def _step_evaluate(cfg: tcfg.TrainConfig, final: Path, workdir: Path, world: int, batches: int) -> dict:
    t0 = time.perf_counter()
    loss, what = _evaluate(cfg, final, workdir, world, batches)
    seconds = time.perf_counter() - t0
    _say("evaluate", f"{what}: {loss:.4f} in {seconds:.1f} s")
    return {"loss": loss, "what": what, "seconds": seconds}


def _step_export(final: Path, workdir: Path) -> dict:
    t0 = time.perf_counter()
    if _command(export_command.register, ["export", "--checkpoint", str(final), "--out", str(workdir / "export")]):
        raise StepFailed("export", "ds-trhash export failed (its output is above)")
    done = {"bytes": fig.directory_bytes(workdir / "export"), "seconds": time.perf_counter() - t0}
    _say("export", f"{gib(done['bytes'])} in {done['seconds']:.1f} s")
    return done


def _step_project(cfg: tcfg.TrainConfig, world: int, workdir: Path, step_s: float, save: dict) -> dict:
    size, save_s = save["checkpoint_bytes"], save["save_seconds"]
    data, _ = resolve_stage_data(cfg, world, deep=False, scratch=workdir)
    plan = CheckpointPlan.for_stage(cfg, data.total_steps, data.loader.steps_per_epoch)
    projection = fig.Projection(data.total_steps, step_s, len(plan.save_steps()), save_s,
                                plan.peak_kept(), size)
    _say("project", f"full run: {projection.total_steps:,} steps x {step_s:.3f} s + {projection.saves} saves x "
                    f"{save_s:.2f} s = {format_duration(projection.wall_seconds)} on {world} process(es); disk "
                    f"{projection.kept_checkpoints} checkpoints kept at once x {gib(size)} = {gib(projection.disk_bytes)}")
    return projection.to_dict()


@os_errors_as(fig.FiguresError)  # a scratch file that cannot be read or written fails the step
def _smoke(args: argparse.Namespace, cfg: tcfg.TrainConfig, world: int, workdir: Path, at: dict) -> dict:
    """The five steps and the projection; ``at["step"]`` names the one running (for a failure)."""
    n, half = args.steps, max(1, args.steps // 2)
    run_dir = workdir / "run"
    owned = ["--output-dir", str(run_dir), "--max-steps", str(n),
             "--set", "training.log_every=1", "--set", f"checkpoint.every_steps={half}",
             "--set", "checkpoint.keep_last=null", "--set", "checkpoint.packs=null"]
    argv = deepspeed_command(str(Path(args.config).resolve()), world, _passthrough(args) + owned)
    final = ckpt.checkpoints_root(run_dir) / ckpt.step_dir_name(n)
    report: dict = {"config": args.config, "processes": world, "steps": n, "workdir": str(workdir)}
    report["train"] = _step_train(argv, n, run_dir, final, workdir, args.timeout)
    at["step"] = "save"
    report["save"] = _step_save(cfg, world, final)
    at["step"] = "resume"
    report["resume"] = _step_resume(argv, half, n, final, workdir, args.timeout)
    at["step"] = "evaluate"
    report["evaluate"] = _step_evaluate(cfg, final, workdir, world, args.eval_batches)
    at["step"] = "export"
    report["export"] = _step_export(final, workdir)
    at["step"] = "project"
    report["projection"] = _step_project(cfg, world, workdir, report["train"]["step_seconds"], report["save"])
    return report


def run_smoke(args: argparse.Namespace) -> int:
    given = [flag for attr, flag in OWNED if getattr(args, attr) not in (None, [])]
    if given:
        raise SmokeArgumentError(f"the smoke chooses {', '.join(given)} itself (a scratch directory, --steps); "
                                 "drop them")
    if args.steps < 2:
        raise SmokeArgumentError(f"--steps must be at least 2 (save, then resume from the middle), got {args.steps}")
    world = args.nproc or default_nproc(probe_devices())
    # batch.grad_accum derived for this world size (micro_batch auto as a CPU launch chooses it)
    cfg = tcfg.for_world(auto_micro_batch.by_estimate(config_from_args(args), world)[0], world)
    if args.workdir:
        workdir = Path(args.workdir).resolve()
        outputs.refuse_unless_ours("--workdir", workdir, False, "ds-trhash smoke")  # new or empty only
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="ds-trhash-smoke-"))
    at = {"step": "train"}
    try:
        report = _smoke(args, cfg, world, workdir, at)
    except UserError as exc:  # the smoke's verdict: the step that failed, and where its logs are
        if isinstance(exc, StepFailed):
            step, text, code = exc.step, str(exc), exc.exit_code
        else:  # a refusal inside a step (the evaluation's, the export's) fails that step
            step, text, code = at["step"], exc.message_lines()[0], EXIT_FAILED
        print(f"smoke FAILED at step {step}: {text}\n(scratch directory kept: {workdir})", file=sys.stderr)
        return code
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.keep or args.workdir:
        print(f"smoke passed; scratch directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        print("smoke passed")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "smoke", parents=[build_arg_parser()], conflict_handler="resolve",
        help="run a stage at its real size for a few steps: train, save, resume, evaluate, export, project",
        description="Runs the config through the deepspeed launcher for --steps steps in a scratch directory, "
                    "goes through save, resume, evaluation and export once, and projects the full run's wall "
                    "time and disk. Takes the launch arguments except --output-dir, --resume and --max-steps.")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to train (default 8; the resume redoes half)")
    p.add_argument("--nproc", type=positive_int, default=None, help="processes (default: one per CUDA device, else 1)")
    p.add_argument("--workdir", default=None, help="an empty directory to work in (kept); default a temporary one")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--eval-batches", type=int, default=4, help="micro-batches of unseen plan rows to evaluate on")
    p.add_argument("--timeout", type=positive_float, default=3600.0, help="seconds one launch may take (default 3600)")
    p.set_defaults(func=run_smoke)
    outputs.writes_dirs(p, "--workdir")
