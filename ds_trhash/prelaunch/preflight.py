"""`ds-trhash preflight`: will this launch run to its end on this machine? Answered in seconds.

It takes the launch's own arguments (``--config``, ``--set``, ``--init-checkpoint``,
``--source-stage``, ``--resume`` ...) plus ``--nproc`` and ``--deep``, builds nothing on a
device, writes nothing, and prints one line per check: devices and precision, the packages
and kernels the profile resolves to, the data, the stage transition from the source
checkpoint, the output directory, memory against an estimate for the micro-batch, and the disk
the run's checkpoints will take. Exit 0 when nothing failed (warnings allowed), 2 otherwise.

The verdicts are the trainer's own: its config validation, data checks, stage guard, output
directory and resume checks, and the resource checks of ``training.resources``, which the
trainer also runs at launch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, TypeVar

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.stages import StageError
from ds_trhash.prelaunch.stage_data import resolve_stage_data
from ds_trhash.training import config as tcfg
from ds_trhash.training import resources as res
from ds_trhash.training.engine import EngineError, check_runnable
from ds_trhash.training.footprint import estimate
from ds_trhash.training.launcher import build_arg_parser, config_from_args
from ds_trhash.training.resources import FAIL, PASS, WARN, Check
from ds_trhash.training.stage_inputs import model_config
from ds_trhash.training.trainer import USER_ERRORS, check_fresh_output_dir, guard_stage, kernel_choice

EXIT_FAILED = 2
# what the launcher prints as one line besides the trainer's USER_ERRORS
LAUNCH_ERRORS = (tcfg.ConfigError, StageError, EngineError, ckpt.CheckpointError)
T = TypeVar("T")
_MARK = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}


class Report:
    """Prints each check as it is made; remembers whether any failed."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.checks: list[Check] = []

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        line = f"{_MARK[check.status]}  {check.name}: {check.detail}"
        if check.fix and check.status != PASS:
            line += f" -> fix: {check.fix}"
        print(line, file=self.stream, flush=True)
        return check

    def run(self, name: str, fn: Callable[[], tuple[T, str]]) -> T | None:
        """``fn`` returns (value, what passed); a user error it raises becomes a failed line."""
        try:
            value, detail = fn()
        except USER_ERRORS + LAUNCH_ERRORS as exc:
            self.add(Check(name, FAIL, " ".join(str(exc).split())))
            return None
        self.add(Check(name, PASS, detail))
        return value

    def skip(self, name: str, because: str) -> None:
        self.add(Check(name, WARN, f"not checked: {because}"))

    def finish(self) -> int:
        failed = sum(c.status == FAIL for c in self.checks)
        warned = sum(c.status == WARN for c in self.checks)
        verdict = "ready to launch" if not failed else "fix the failed checks before launching"
        print(f"preflight: {len(self.checks) - failed - warned} passed, {warned} warning(s), {failed} failed: "
              f"{verdict}", file=self.stream, flush=True)
        return EXIT_FAILED if failed else 0


# ----------------------------------------------------------------------------- launch state


def _output_and_resume(report: Report, cfg, args, world: int, data, lora: bool):
    """The trainer's output-directory and resume checks; returns (saved trainer state or None,
    steps of complete checkpoints already there)."""
    output_dir = Path(cfg.output_dir)
    notes: list[str] = []
    existing = [c.step for c in ckpt.list_checkpoints(output_dir) if c.has_manifest]

    def output():
        ckpt.check_output_dir_stage(output_dir, cfg.stage)
        resume_dir = ckpt.resolve_resume(args.resume, os.environ.get("RESUME"), output_dir, log=notes.append)
        if resume_dir is None:
            if not args.resume and not os.environ.get("RESUME"):
                check_fresh_output_dir(output_dir)
            state = "does not exist yet" if not output_dir.exists() else "holds no run"
            return None, f"{output_dir} {state}: a fresh start" + (f" ({notes[-1]})" if notes else "")
        saved = ckpt.read_trainer_state(resume_dir)
        if data is not None:
            ckpt.check_resume_compatible(
                saved, tcfg.training_critical(cfg), world_size=world, lora_enabled=lora,
                total_steps=data.total_steps, stage=cfg.stage, reshard=args.reshard,
                plan_sha256=data.plan.sha256 if data.plan is not None else None,
                found=ckpt.inspect_saved_parts(resume_dir))
        how = "and is compatible with this launch" if data is not None else "(compatibility not checked: data failed)"
        return saved, f"{output_dir} holds a run; --resume continues it from {Path(resume_dir).name} {how}"

    saved = report.run("output", output)
    return saved, existing


def _source(report: Report, cfg, init_dir: str | None, data, resuming: bool) -> None:
    def stage():
        if init_dir is not None:
            path = Path(init_dir)
            if not path.is_dir():
                raise ckpt.CheckpointError(f"--init-checkpoint {path} does not exist")
            if (path / ckpt.TRAINER_STATE).is_file():
                ok, reason = ckpt.verify(path, deep=False)
                if not ok:
                    raise ckpt.CheckpointError(f"--init-checkpoint {path} is {reason}")
        record = guard_stage(cfg, init_dir, data, resuming=resuming)
        if record is None:
            return None, f"{cfg.stage} from scratch" if not resuming else "resumed run (checked at its first launch)"
        return None, f"{record.stage.value} -> {cfg.stage} from {init_dir} is allowed"

    report.run("stage", stage)


# ----------------------------------------------------------------------------- resources


def _data(cfg, model_cfg, world: int, deep: bool, scratch: Path):
    resolved = resolve_stage_data(cfg, model_cfg, world, deep, scratch)
    return resolved, resolved.detail


def run_preflight(args: argparse.Namespace) -> int:
    report = Report()
    try:
        cfg = config_from_args(args)
    except tcfg.ConfigError as exc:
        report.add(Check("config", FAIL, str(exc)))
        return report.finish()
    devices = res.probe_devices()
    world = args.nproc or res.default_nproc(devices)

    def config():
        tcfg.require_source_stage(cfg)
        check_runnable(cfg, world)
        return None, (f"{cfg.origin}: {cfg.stage}, preset {cfg.model.preset}, {cfg.precision}, ZeRO {cfg.zero.stage}, "
                      f"{tcfg.tokens_per_step(cfg, world):,} tokens per optimizer step on {world} process(es)")

    report.run("config", config)
    report.add(res.check_devices(devices, world))
    report.add(res.check_precision(cfg.precision, devices))
    model_cfg = model_config(cfg)
    deepspeed = report.add(res.check_deepspeed())
    device = torch.device("cuda", 0) if devices.kind == "cuda" else torch.device("cpu")

    def kernels():
        choice = kernel_choice(cfg, model_cfg, device)
        return choice, (f"experts={choice.experts} loss={choice.loss} norm={choice.norm} rope={choice.rope} "
                        f"({choice.reason})")

    choice = report.run("kernels", kernels)
    for check in res.kernel_packages(choice) if choice is not None else []:
        report.add(check)
    if not deepspeed.failed:
        report.add(res.check_comm_op(devices))
    with tempfile.TemporaryDirectory(prefix="ds-trhash-preflight-") as scratch:
        resolved = report.run("data", lambda: _data(cfg, model_cfg, world, args.deep, Path(scratch)))
    data, spe = (resolved.data, resolved.steps_per_epoch) if resolved is not None else (None, None)
    saved, existing = _output_and_resume(report, cfg, args, world, data, cfg.lora.enabled)
    init_dir = args.init_checkpoint or (saved or {}).get("init_checkpoint")
    if data is None:
        report.skip("stage", "the data check failed")
    else:
        _source(report, cfg, init_dir, data, resuming=saved is not None)
    footprint = estimate(cfg, model_cfg, world, devices.kind)
    report.add(res.check_memory(footprint, devices, world))
    if data is None:
        report.skip("disk", "the step count comes from the data, whose check failed")
    else:
        # a fresh start holds no complete checkpoint (else the output check failed): size it as one
        after, existing = (int(saved["step"]), existing) if saved else (0, [])
        for check in res.check_disk(res.disk_needs(cfg, footprint, data.total_steps, spe, world, after, existing)):
            report.add(check)
    return report.finish()


def register(sub) -> None:
    p = sub.add_parser(
        "preflight", parents=[build_arg_parser()], conflict_handler="resolve",
        help="check a launch against this machine in seconds: devices, memory, disk, packages, data, stage, output",
        description="Takes the arguments of `deepspeed launch/train.py` and checks, without building the model "
                    "or writing anything, that the launch can run to its end here. Exit 0: no check failed.")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes the launch starts on this node (default: one per CUDA device, else 1)")
    p.add_argument("--deep", action="store_true",
                   help="also hash every shard the plan reads against its manifest (as long as reading it once)")
    p.set_defaults(func=run_preflight)
