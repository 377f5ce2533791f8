"""`ds-trhash preflight`: will this launch run to its end on this machine? Answered in seconds.

It takes the launch's own arguments (``--config``, ``--set``, ``--init-checkpoint``,
``--source-stage``, ``--resume`` ...) plus ``--nproc`` and ``--deep``, builds nothing on a
device, writes nothing, and prints one line per check: devices and precision, the packages
and kernels the profile resolves to, the data, the stage transition from the source
checkpoint, the output directory, memory against an estimate for the micro-batch, and the disk
the run's checkpoints will take. Exit 0 when nothing failed (warnings allowed), 2 otherwise.

The verdicts are the trainer's own: the checks ``training.preparation.plan.plan_launch`` makes for a
launch (config validation, data checks, stage guard and the --init-checkpoint's weights, output
directory and resume checks, the kernel choice), called one by one here so that each gets its
line, and the resource checks of ``training.preparation.resources``, whose cheap part the trainer also
runs at launch.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Callable, TextIO, TypeVar

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.argtypes import positive_int
from ds_trhash.errors import EXIT_USER_ERROR, UserError
from ds_trhash.model.backend import KernelChoice
from ds_trhash.model.config import TRHashConfig
from ds_trhash.prelaunch.data_check import resolve_stage_data
from ds_trhash.training import config as tcfg
from ds_trhash.training.engine import check_runnable
from ds_trhash.training.memory import auto as auto_micro_batch
from ds_trhash.training.preparation import checks as launch_checks
from ds_trhash.training.preparation import resources as res
from ds_trhash.training.preparation.footprint import estimate
from ds_trhash.training.preparation.init_weights import read_init_weights
from ds_trhash.training.preparation.output import OutputSide, check_output_side, check_resume
from ds_trhash.training.preparation.plan import kernel_choice
from ds_trhash.training.preparation.resources import FAIL, PASS, WARN, Check
from ds_trhash.data.stage import StageData
from ds_trhash.training.preparation.stage_guard import guard_stage
from ds_trhash.training.entrypoint import build_arg_parser, launch_config, launch_request
from ds_trhash.training.preparation.request import LaunchRequest

T = TypeVar("T")
_MARK = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}


class Report:
    """Prints each check as it is made; remembers whether any failed."""

    def __init__(self, stream: TextIO | None = None) -> None:
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
        """``fn`` returns (value, what passed); a user error it raises (the refusal the launch
        would print) becomes a failed line; any other exception is a bug and propagates."""
        try:
            value, detail = fn()
        except UserError as exc:
            self.add(Check(name, FAIL, exc.message_lines()[0]))
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
        return EXIT_USER_ERROR if failed else 0


# ----------------------------------------------------------------------------- launch state


def _output(report: Report, cfg: tcfg.TrainConfig, request: LaunchRequest, world: int,
            data: StageData | None) -> OutputSide | None:
    """The trainer's output-side checks and, when resuming, its resume checks."""
    output_dir = Path(cfg.output_dir)

    def output() -> tuple[OutputSide, str]:
        pre = check_output_side(cfg, request, 0)
        # what the launch would set aside, each with why (damaged, or records that disagree)
        set_aside = (f"; {len(pre.damaged)} damaged checkpoint(s) would be set aside ("
                     + "; ".join(f"{name} is {why}" for name, why in pre.damaged) + ")") if pre.damaged else ""
        if pre.saved is None:
            state = "does not exist yet" if not output_dir.exists() else "holds no run"
            if pre.damaged:  # --allow-fresh-over-damaged: the earlier run's files go aside too
                set_aside += ", with every file of the earlier run that the new one writes"
            return pre, f"{output_dir} {state}: a fresh start{set_aside}"
        resume_dir = pre.resume_dir  # set with pre.saved
        if data is None or resume_dir is None:
            return pre, f"{output_dir} holds a run; resume compatibility not checked (the data check failed)"
        check_resume(cfg, request, world, data, pre.saved, resume_dir)
        if int(pre.saved["step"]) == data.total_steps:
            return pre, (f"{output_dir} holds this stage finished ({Path(resume_dir).name} is its last step): "
                         "--resume auto trains nothing, completes any end-of-stage record an interrupted end "
                         "left out, and exits 0")
        return pre, (f"{output_dir} holds a run; --resume continues it from {Path(resume_dir).name} exactly"
                     f"{set_aside}")

    return report.run("output", output)


def _source(report: Report, cfg: tcfg.TrainConfig, request: LaunchRequest, pre: OutputSide | None,
            data: StageData, model_cfg: TRHashConfig) -> None:
    def stage() -> tuple[None, str]:
        init_dir = pre.init_dir if pre is not None else launch_checks.resolve_init_checkpoint(
            request.init_checkpoint, log=lambda *_: None)
        resuming = pre is not None and pre.saved is not None
        if init_dir is not None and (Path(init_dir) / ckpt.TRAINER_STATE).is_file():
            ok, reason = ckpt.verify(init_dir, deep=False)
            if not ok:
                raise ckpt.CheckpointError(f"--init-checkpoint {init_dir} is {reason}")
        record = guard_stage(cfg, init_dir, data, resuming=resuming)
        if record is None:
            return None, f"{cfg.stage} from scratch" if not resuming else "resumed run (checked at its first launch)"
        if not resuming and init_dir is not None:  # the launch's own read: every file against its manifest, the tensors against the model
            read_init_weights(init_dir, model_cfg)
        source = record.stage.value if record.stage is not None else "a checkpoint"
        return None, (f"{source} -> {cfg.stage} from {init_dir} is allowed"
                      + ("" if resuming else "; its weights verify and fit the model"))

    report.run("stage", stage)


# ----------------------------------------------------------------------------- the command


def _config_line(cfg: tcfg.TrainConfig, world: int) -> tuple[tcfg.TrainConfig, str]:
    """The config laid out on ``world`` ranks (``micro_batch: auto`` by the estimate) and its line."""
    tcfg.require_source_stage(cfg)
    check_runnable(cfg, world)
    laid, choice = auto_micro_batch.by_estimate(cfg, world)
    how = "" if choice is None else (f"; batch.micro_batch auto: {choice.micro_batch} by the estimate (a launch "
                                     "on CUDA probes the device)")
    return tcfg.for_world(laid, world), (f"{cfg.origin}: {cfg.stage}, {cfg.model.describe()}, {cfg.precision}, ZeRO "
                                         f"{cfg.zero.stage}, {tcfg.tokens_per_step(laid, world):,} tokens per optimizer "
                                         f"step on {world} process(es){how}")


def run_preflight(args: argparse.Namespace) -> int:
    report = Report()
    try:
        request = launch_request(args)  # the command line and RESUME, TARGET_TOKENS: read once, here
        cfg = launch_config(request)
    except tcfg.ConfigError as exc:
        report.add(Check("config", FAIL, str(exc)))
        return report.finish()
    devices = res.probe_devices()
    world = args.nproc or res.default_nproc(devices)

    loaded = cfg
    cfg = report.run("config", lambda: _config_line(loaded, world)) or cfg  # batch.grad_accum derived for this world
    def paths() -> tuple[None, str]:
        tcfg.check_paths(cfg)
        return None, "every path the config names exists and is of its kind"

    report.run("paths", paths)
    report.add(res.check_devices(devices, world))
    report.add(res.check_precision(cfg.precision, devices))
    model_cfg = tcfg.model_config(cfg)
    deepspeed = report.add(res.check_deepspeed())
    device = torch.device("cuda", 0) if devices.kind == "cuda" else torch.device("cpu")

    def kernels() -> tuple[KernelChoice, str]:
        choice = kernel_choice(cfg, model_cfg, device)
        return choice, (f"experts={choice.experts} loss={choice.loss} norm={choice.norm} rope={choice.rope} "
                        f"({choice.reason})")

    choice = report.run("kernels", kernels)
    for check in res.kernel_packages(choice) if choice is not None else []:
        report.add(check)
    if not deepspeed.failed:
        report.add(res.check_comm_op(devices))
    with tempfile.TemporaryDirectory(prefix="ds-trhash-preflight-") as scratch:
        data = report.run("data", lambda: resolve_stage_data(cfg, world, args.deep, Path(scratch),
                                                                request.target_tokens))
    pre = _output(report, cfg, request, world, data)
    saved = pre.saved if pre is not None else None
    if data is None:
        report.skip("stage", "the data check failed")
    else:
        _source(report, cfg, request, pre, data, model_cfg)
    footprint = estimate(cfg, model_cfg, world, devices.kind)
    report.add(res.check_memory(footprint, devices, world))
    if data is None:
        report.skip("disk", "the step count comes from the data, whose check failed")
    else:
        # a fresh start holds no complete checkpoint (else the output check failed): size it as one
        existing = [c.step for c in ckpt.list_checkpoints(cfg.output_dir) if c.has_manifest] if saved else []
        spe = data.loader.steps_per_epoch
        after = int(saved["step"]) if saved else 0
        for check in res.check_disk(res.disk_needs(cfg, footprint, data.total_steps, spe, world, after, existing)):
            report.add(check)
    return report.finish()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preflight", parents=[build_arg_parser()], conflict_handler="resolve",
        help="check a launch against this machine in seconds: devices, memory, disk, packages, data, stage, output",
        description="Takes the arguments of `deepspeed launch/train.py` and checks, without building the model "
                    "or writing anything, that the launch can run to its end here. Exit 0: no check failed.")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="processes the launch starts on this node (default: one per CUDA device, else 1)")
    p.add_argument("--deep", action="store_true",
                   help="also hash every shard the plan reads against its manifest (as long as reading it once)")
    p.set_defaults(func=run_preflight)
