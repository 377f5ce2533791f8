"""The output side of a launch: what ``--resume`` / ``RESUME``, ``--init-checkpoint`` and the
output directory decide, and whether a resume continues the saved run exactly.

The launcher runs :func:`check_output_paths` before it takes the run lock and
:func:`check_output_side` while holding it; ``ds-trhash preflight`` runs both checks read-only.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_trhash import checkpoints as ckpt
from ds_trhash import outputs
from ds_trhash.training import config as tcfg
from ds_trhash.training.preparation import checks as launch_checks
from ds_trhash.training.preparation.request import LaunchRequest
from ds_trhash.data.stage import StageData

log = logging.getLogger("ds_trhash.trainer")


@dataclass(frozen=True)
class OutputSide:
    """What the command line and the output directory decided, before anything was written."""

    resume_dir: ckpt.CheckpointInfo | None  # the checkpoint a resume continues from
    saved: dict[str, Any] | None  # its trainer_state.json
    init_dir: str | None  # --init-checkpoint, or the one the resumed run was initialised from
    damaged: list  # (name, why) of checkpoints to set aside: all (--allow-fresh-over-damaged) or those newer than resume_dir


def check_output_paths(cfg: tcfg.TrainConfig, request: LaunchRequest) -> None:
    """The refusals that need only the command line and the output path, not what the output
    directory holds: the launcher makes them before it takes the run lock (which creates the
    directory), so a wrong path is refused without touching anything."""
    output_dir = Path(cfg.output_dir)
    launch_checks.check_output_location(output_dir)
    flag, env = request.resume_flag, request.resume_env
    if flag and env and flag != env:
        ckpt.resolve_resume(flag, env, output_dir)  # refuses the disagreement
    launch_checks.check_flags(request)
    outputs.check_dir_target("--output-dir", output_dir)


def check_output_side(cfg: tcfg.TrainConfig, request: LaunchRequest, rank: int) -> OutputSide:
    """Fresh start, resume (from which checkpoint) or refusal: what the command line and the
    output directory decide. The launcher runs this while rank 0 holds the output directory's
    run lock (the other ranks after the process group started, which waits for rank 0), so no
    other launch changes the directory between this decision and the run's first write; nothing
    is written until all of these and the data checks pass."""
    output_dir = Path(cfg.output_dir)
    check_output_paths(cfg, request)
    say = log.info if rank == 0 else (lambda *_: None)
    resume_choice = request.resume
    damaged: list = []
    if resume_choice == "auto":
        resume_dir, damaged = launch_checks.resume_auto(output_dir, request.allow_fresh_over_damaged, log=say)
    else:
        resume_dir = ckpt.resolve_resume(request.resume_flag, request.resume_env, output_dir, log=say)
    saved = ckpt.read_trainer_state(resume_dir) if resume_dir else None
    explicit = resume_dir.path if resume_dir is not None and resume_choice != "auto" else None
    init_dir = launch_checks.resolve_init_checkpoint(request.init_checkpoint, log=say)
    launch_checks.check_not_own_source(output_dir, init_dir, explicit)
    if explicit is not None:
        launch_checks.check_resume_source(explicit, output_dir, request.fork, (saved or {}).get("output_dir"))
    if saved is not None and init_dir is None:
        init_dir = saved.get("init_checkpoint")
    if not damaged or resume_dir is not None:
        ckpt.check_output_dir_stage(output_dir, cfg.stage)
    if saved is None and resume_choice is None:
        launch_checks.check_fresh_output_dir(output_dir)
    launch_checks.probe_writable(output_dir)
    return OutputSide(resume_dir, saved, init_dir, damaged)


def check_resume(cfg: tcfg.TrainConfig, request: LaunchRequest, world: int, data: StageData, saved: dict,
                 resume_dir: str | os.PathLike) -> bool:
    """An exact resume continues the saved run: every training-critical setting, the world size
    (unless --reshard), the plan file, the saved parts, the SFT set. True when it reshards."""
    ckpt.check_resume_compatible(
        saved, tcfg.training_critical(cfg, world), world_size=world, lora_enabled=cfg.lora.enabled,
        total_steps=data.total_steps, stage=cfg.stage, reshard=request.reshard,
        plan_sha256=data.plan.sha256 if data.plan is not None else None,
        found=ckpt.inspect_saved_parts(resume_dir), finished_ok=request.resumes_auto,
    )
    launch_checks.check_sft_manifest_unchanged(saved.get("sft_manifest_sha256"), data.sft_manifest_sha256, data.sft_dir)
    return ckpt.is_reshard(saved, world, request.reshard, cfg.parallel.ep_size)
