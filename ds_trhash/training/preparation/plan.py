"""The plan of one launch: everything decided before the model exists, as one typed record.

:func:`plan_launch` makes every check that can refuse a launch, in this order: the config on
this world size, the output side (resume or fresh, from which checkpoint), the stage's data,
the stage guard, every callback's own inputs, an exact resume's compatibility, the machine's
resources, the ``--init-checkpoint`` weights (verified, read and fitted to the model on the meta
device, ``init_weights``), and the kernels (the policy resolved for the device, each fused kernel
run once against PyTorch). It writes nothing and starts nothing (the data side starts once the
plan stands), so a wrong launch costs seconds and leaves nothing to tear down. The trainer builds
the model and the engine from the plan; ``ds-trhash preflight`` makes the same checks one by one
(``check_output_side``, ``check_resume``, ``guard_stage``, ``read_init_weights``,
``kernel_choice``, the resource checks), printing a line for each.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.batch_layout import BatchLayout
from ds_trhash.checkpoints.hardware import describe_hardware
from ds_trhash.checkpoints.stages import SourceRecord
from ds_trhash.checkpoints.weights import read_source_metadata
from ds_trhash.data.stage import StageData, StageRequest, open_stage_data
from ds_trhash.model import backend, expert_probe, selfcheck
from ds_trhash.model.config import TRHashConfig
from ds_trhash.training import config as tcfg
from ds_trhash.training.callbacks import Callback, build_callbacks, training_parts
from ds_trhash.training.callbacks.base import Builder
from ds_trhash.training.checkpoint_plan import CheckpointPlan
from ds_trhash.training.engine import check_runnable, compute_dtype
from ds_trhash.training.global_batch import GlobalBatch
from ds_trhash.training.memory import auto as auto_micro_batch
from ds_trhash.training.preparation import resources
from ds_trhash.training.preparation.init_weights import InitWeights, read_init_weights
from ds_trhash.training.preparation.output import OutputSide, check_output_side, check_resume
from ds_trhash.training.preparation.request import LaunchRequest
from ds_trhash.training.preparation.stage_guard import guard_stage
from ds_trhash.training.records.files import TRAINER_FILES

log = logging.getLogger("ds_trhash.trainer")


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of one stage, decided: what it resumes or initialises from, what it trains on,
    with which kernels and batch layout, and where it writes."""

    cfg: tcfg.TrainConfig  # for this world size (batch.grad_accum derived)
    loaded: tcfg.TrainConfig  # as loaded: what config.json records
    world: int
    model_config: TRHashConfig
    output: OutputSide  # resume or fresh, from which checkpoint; damaged checkpoints to set aside
    data: StageData
    source: SourceRecord | None  # the stage guard's verdict: the checkpoint this stage starts from
    resharding: bool  # --reshard onto another world size: universal load, re-seeded RNG
    critical: dict[str, Any]  # the training-critical settings a resume must match
    layout: GlobalBatch
    checkpoints: CheckpointPlan  # cadence, token-pack boundaries, epoch ends
    device: torch.device
    kernels: backend.KernelChoice
    builders: tuple[Builder, ...]  # the callbacks the config asks for, inputs checked
    initial: InitWeights | None = None  # the --init-checkpoint's weights, checked (None on a resume)
    auto: auto_micro_batch.AutoChoice | None = None  # batch.micro_batch auto: the size chosen and why
    run_files: tuple[str, ...] = TRAINER_FILES  # what the launch writes at the top of its output directory

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def resuming(self) -> bool:
        return self.output.saved is not None

    @property
    def start_step(self) -> int:
        saved = self.output.saved
        return int(saved["step"]) if saved is not None else 0  # saved: resuming

    @property
    def init_weights(self) -> str | None:
        """The checkpoint whose weights initialise the model (a resume restores the engine instead)."""
        return None if self.resuming else self.output.init_dir

    def record(self) -> ckpt.LaunchRecord:
        """What every trainer_state.json of this launch records about it."""
        cfg, data = self.cfg, self.data
        return ckpt.LaunchRecord(
            stage=cfg.stage, family=cfg.model.family, world_size=self.world, training_critical=self.critical,
            plan_fingerprint=data.plan.fingerprint if data.plan is not None else None,
            plan_sha256=data.plan.sha256 if data.plan is not None else None,
            plan_doc=data.plan.doc if data.plan is not None else None,
            init_checkpoint=str(self.output.init_dir) if self.output.init_dir else None, lora=cfg.lora.enabled,
            model_config=self.model_config.to_dict(), tokenizer_dir=data.tokenizer_dir,
            tokenizer_sha256=data.tokenizer_sha256, tokenizer_assumed=data.tokenizer_assumed, sft_dir=data.sft_dir,
            sft_manifest_sha256=data.sft_manifest_sha256,
            source_stage=cfg.source_stage, hardware=f"{self.world} process(es); rank 0 on {describe_hardware()}",
            pack_of=dict(self.checkpoints.pack_of), output_dir=str(Path(cfg.output_dir).resolve()),
            data_source=data.data_source, planned_steps=data.planned_steps)


def launch_device() -> torch.device:
    """This rank's device: its current CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def kernel_choice(cfg: tcfg.TrainConfig, model_cfg: TRHashConfig, device: torch.device) -> backend.KernelChoice:
    """The kernels this launch runs: the policy resolved for the device, then every selected fused
    kernel run once against PyTorch on it, then the experts backend settled for the launch's
    shape (``kernels.experts``; measured on CUDA under auto). ``ds-trhash preflight`` calls it too."""
    choice = backend.resolve(cfg.kernels.policy, device, model_cfg, require_liger=cfg.kernels.require_liger)
    choice = selfcheck.verify(choice, cfg.kernels.policy, device, model_cfg, dtype=compute_dtype(cfg.precision),
                              require_liger=cfg.kernels.require_liger)
    if cfg.parallel.ep_size > 1:  # the expert-parallel layer runs its own (gathered) path
        return choice
    shape = expert_probe.Shape(tokens=tcfg.micro_batch(cfg) * cfg.data.seq_len, hidden=model_cfg.hidden_size,
                               width=model_cfg.expert_width, experts=model_cfg.num_experts,
                               dtype=compute_dtype(cfg.precision), device=device)
    return expert_probe.choose_experts(choice, cfg.kernels.experts, shape)


def warn_resources(cfg: tcfg.TrainConfig, model_cfg: TRHashConfig, data: StageData, world: int, rank: int,
                   output: OutputSide) -> None:
    """The cheap part of ``ds-trhash preflight``: refuse an output filesystem that cannot hold one
    more checkpoint; log a warning when it cannot hold every checkpoint the run keeps, or when
    the memory estimate does not fit this rank's device (or the host, on CPU)."""
    output_dir, saved = Path(cfg.output_dir), output.saved
    devices = resources.probe_devices(torch.cuda.current_device() if torch.cuda.is_available() else None)
    local = 1 if devices.kind == "cuda" else resources.local_processes(world)
    existing = [c.step for c in ckpt.list_checkpoints(output_dir) if c.has_manifest] if saved is not None else []
    for warning in resources.check_at_launch(
            cfg, model_cfg, world, local, devices, data.total_steps, data.loader.steps_per_epoch,
            after=int(saved["step"]) if saved is not None else 0, existing=existing,
            output_free=resources.shared_free_bytes(output_dir)):
        if rank == 0:
            log.warning("%s: %s; %s", warning.name, warning.detail, warning.fix)


def data_request(cfg: tcfg.TrainConfig, rank: int, world: int) -> StageRequest:
    """What the data package needs of this launch to open its stage's data: the ``data:``
    section and this rank's cut of the step (grad_accum derived for this world size)."""
    step = tcfg.batch_layout(cfg, world)
    return StageRequest(
        data=cfg.data, stage=cfg.stage, origin=str(cfg.origin), output_dir=cfg.output_dir, seed=cfg.seed,
        layout=BatchLayout(step.micro_batch, step.grad_accum, rank=rank, world_size=world),
        vocab_size=tcfg.model_config(cfg).vocab_size, model=cfg.model.describe(), preset=cfg.model.preset,
        max_steps=cfg.training.max_steps, epochs=cfg.training.epochs, heldout=cfg.eval.heldout)


def held_to(cfg: tcfg.TrainConfig, output: OutputSide) -> dict:
    """Whose corpus record this launch reads again: its own checkpoint's on a resume; on a fresh
    refinement, the pretraining checkpoint's (refinement never resolves the branch again)."""
    if output.saved is not None:
        return {"saved_source": output.saved.get("data_source"), "read_by": "this run"}
    if cfg.stage == "refinement" and output.init_dir:
        return {"saved_source": read_source_metadata(output.init_dir).get("data_source"), "read_by": "pretraining"}
    return {}


def plan_launch(cfg: tcfg.TrainConfig, request: LaunchRequest, rank: int, world: int,
                parts: Sequence[type[Callback]] | None = None, checked: OutputSide | None = None) -> LaunchPlan:
    """Every check of the launch, before the model exists; raises the first refusal. ``request``:
    the command line and environment, resolved by the entry point. ``parts``:
    the callback classes of the launch (default ``training_parts()``); ``checked``: what
    ``check_output_side`` decided before the process group existed."""
    tcfg.require_source_stage(cfg)
    check_runnable(cfg, world)
    loaded, model_cfg = cfg, tcfg.model_config(cfg)
    output = checked if checked is not None else check_output_side(cfg, request, rank)
    device = launch_device()
    # batch.micro_batch auto: chosen (or taken from the run's record) before the data cuts its rows
    cfg, auto = auto_micro_batch.resolve(cfg, model_cfg, world, device, rank, output.saved)
    cfg = tcfg.for_world(cfg, world)  # batch.grad_accum derived for this world size
    # the data: plan, budgets, tokenizer identity, every planned shard listed (reads only; the
    # embedded demo corpus is built once into its own content-named folder, shared by runs)
    data = open_stage_data(data_request(cfg, rank, world), **held_to(cfg, output), target_tokens=request.target_tokens)
    for note in data.notes:  # e.g. that the corpus records no tokenizer and data.tokenizer is assumed
        if rank == 0:
            log.info(note)
    source = guard_stage(cfg, output.init_dir, data, resuming=output.saved is not None)
    capped = ckpt.capped_by(read_source_metadata(output.init_dir)) if output.init_dir else None
    if capped and rank == 0:  # e.g. refinement from a pretraining cut short: legal, but it should be said
        log.warning("--init-checkpoint %s comes from a stage %s", output.init_dir, capped)
    # every callback checks its own inputs now (a malformed PIQA file fails here, before the model)
    classes = list(parts) if parts is not None else training_parts()
    builders = build_callbacks(classes, cfg)
    resharding = False
    if output.saved is not None and output.resume_dir is not None:  # a saved state comes from its checkpoint
        resharding = check_resume(cfg, request, world, data, output.saved, output.resume_dir)
    warn_resources(cfg, model_cfg, data, world, rank, output)
    # read once, here: a damaged or foreign checkpoint is refused before the data side starts
    initial = read_init_weights(output.init_dir, model_cfg) if output.saved is None and output.init_dir else None
    choice = kernel_choice(cfg, model_cfg, device)
    return LaunchPlan(
        cfg=cfg, loaded=loaded, world=world, model_config=model_cfg, output=output, data=data, source=source,
        resharding=resharding, critical=tcfg.training_critical(cfg, world), layout=tcfg.batch_layout(cfg, world),
        auto=auto,
        checkpoints=CheckpointPlan.for_stage(cfg, data.total_steps, data.loader.steps_per_epoch),
        device=device, kernels=choice, builders=tuple(builders), initial=initial,
        run_files=tuple(dict.fromkeys([*TRAINER_FILES, *(name for part in classes for name in part.run_files)])))
