"""One launch of one stage: config → data → stage guard → model → engine → loop.

Everything that can refuse a launch (config, data manifests, plan identity, stage transition,
resume compatibility) runs before the model is allocated, so a wrong launch costs seconds and
writes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.rng import RNGStateError, load_rng_state, restore_rng_state
from ds_trhash.checkpoints.stages import SourceRecord, StageError, check_launch
from ds_trhash.data.budget import BudgetError
from ds_trhash.data.cache import CacheError
from ds_trhash.data.stream import CorpusError
from ds_trhash.data.store import StoreError
from ds_trhash.data.embedded import EmbeddedError
from ds_trhash.data.plan import PlanError, unique_core_fingerprint, validate_refinement
from ds_trhash.data.reader import ReaderError
from ds_trhash.data.sft_build import SFTBuildError
from ds_trhash.data.sft_dataset import SFTDataError
from ds_trhash.data.shards import ShardError
from ds_trhash.data.tokenizer import TokenizerError
from ds_trhash.model import TRHashForCausalLM, backend, selfcheck
from ds_trhash.model.backend import BackendError
from ds_trhash.model.compile import compile_model
from ds_trhash.model.lora import LoRAError, apply_lora
from ds_trhash.model.routing import RouteTableError
from ds_trhash.safe_names import UnsafeNameError
from ds_trhash.training import config as tcfg
from ds_trhash.training import launch_checks, loop, resources
from ds_trhash.training.callbacks import (
    Callback,
    FaultInjection,
    LauncherWatch,
    RunContext,
    StopAgreement,
    build_callbacks,
    make_callbacks,
    training_parts,
)
from ds_trhash.training.callbacks.stop import install as install_stop_handlers
from ds_trhash.training.checkpoint_plan import CheckpointPlan
from ds_trhash.training.engine import (
    build_engine,
    check_runnable,
    compute_dtype,
    describe_hardware,
    expert_parallel_group,
    optimizer_name,
)
from ds_trhash.training.expert_load import EXPERT_LOAD_FILE, ExpertLoadWriter
from ds_trhash.training.metrics import METRICS_FILE, MetricsError, MetricsWriter
from ds_trhash.training.monitor import MonitorSink
from ds_trhash.training.progress import Progress
from ds_trhash.training.stage_data import StageData, _barrier, prepare_pretrain_data, prepare_sft_data
from ds_trhash.training.summary import startup_summary

log = logging.getLogger("ds_trhash.trainer")


# Errors that describe a wrong launch (bad data, config, checkpoint): the launcher prints them
# as one line and exits 2 instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    PlanError, SFTDataError, BackendError, RouteTableError, FileNotFoundError, loop.LabelError, BudgetError,
    CacheError, EmbeddedError, ReaderError, ShardError, SFTBuildError, TokenizerError, LoRAError, MetricsError,
    RNGStateError, resources.ResourceError, UnsafeNameError, CorpusError, StoreError)


# ----------------------------------------------------------------------------- launch checks


def _source_record(init_dir: str | None) -> tuple[SourceRecord | None, dict]:
    if init_dir is None:
        return None, {}
    meta = ckpt.read_source_metadata(init_dir)
    return SourceRecord.from_mapping(meta, path=str(init_dir)), meta


def check_tokenizer_identity(source_meta: dict, data: StageData, init_dir: str) -> None:
    """The data of the next stage must be tokenized exactly like the source model's: token ids
    (and with them the persisted routes) mean nothing under another tokenizer."""
    theirs, ours = source_meta.get("tokenizer_sha256"), data.tokenizer_sha256
    if theirs and ours and theirs != ours:
        raise StageError(
            f"the data of this launch was tokenized with tokenizer {ours[:12]}…, but {init_dir} was trained with "
            f"tokenizer {theirs[:12]}…; rebuild the data with the checkpoint's tokenizer")


def guard_stage(cfg: tcfg.TrainConfig, init_dir: str | None, data: StageData, resuming: bool) -> SourceRecord | None:
    """docs/contracts.md §3, before the model exists. A resume re-checks the record of the first launch."""

    record, source_meta = _source_record(init_dir)
    if record is None and resuming:
        return None
    if record is not None:
        check_tokenizer_identity(source_meta, data, init_dir)
    check_launch(
        cfg.stage, record,
        source_stage_flag=cfg.source_stage,
        target_plan_doc=data.plan.doc if data.plan is not None else None,
        source_plan_doc=source_meta.get("plan_doc"),
        fresh_optimizer=True,
        family=cfg.model.family,
        validate_refinement=validate_refinement,
        plan_fingerprint=unique_core_fingerprint,
    )
    return record


# ----------------------------------------------------------------------------- model


def kernel_choice(cfg: tcfg.TrainConfig, model_cfg, device: torch.device) -> backend.KernelChoice:
    """The kernels this launch runs: the policy resolved for the device, then every selected fused
    kernel run once against PyTorch on it (``ds-trhash preflight`` makes the same two calls)."""
    choice = backend.resolve(cfg.kernels.policy, device, model_cfg, require_liger=cfg.kernels.require_liger)
    return selfcheck.verify(choice, cfg.kernels.policy, device, model_cfg, dtype=compute_dtype(cfg.precision),
                            require_liger=cfg.kernels.require_liger)


def build_model(cfg: tcfg.TrainConfig, model_cfg, init_dir: str | None, device: torch.device, rank: int):
    torch.manual_seed(cfg.seed)
    model = TRHashForCausalLM(model_cfg)
    if init_dir is not None:
        state_dict, _ = ckpt.load_merged_weights(init_dir)  # an SFT→SFT LoRA source arrives merged
        differences = model.load_checkpoint_state(state_dict)
        for line in differences:
            log.warning("routes kept from the checkpoint: %s", line)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
    if cfg.parallel.ep_size > 1:
        # Full model first (same init / init-checkpoint as ep_size 1), then keep this rank's experts.
        # lazy: expert_parallel imports deepspeed.moe (seconds), needed only when ep_size > 1
        from ds_trhash.model.expert_parallel import enable_expert_parallel

        enable_expert_parallel(model, cfg.parallel.ep_size, group=expert_parallel_group(cfg.parallel.ep_size))
    choice = kernel_choice(cfg, model_cfg, device)
    backend.apply(model, choice)
    model.kernels_requested = choice.to_dict()  # for the startup summary
    if rank == 0:
        log.info("kernels requested: %s (%s)", choice.to_dict(), choice.reason)
    compile_model(model, cfg.kernels.compile)  # in place: state-dict names unchanged
    return model.to(device)


# ----------------------------------------------------------------------------- what checkpoints record


def checkpoint_plan(cfg: tcfg.TrainConfig, data: StageData) -> CheckpointPlan:
    """Token-pack boundaries (pack number per step) and, for SFT, epoch ends: the steps
    rotation never removes, with the cadence and rotation of ``cfg.checkpoint``."""
    return CheckpointPlan.for_stage(cfg, data.total_steps, getattr(data.batches, "steps_per_epoch", None))


def check_resources(cfg: tcfg.TrainConfig, model_cfg, data: StageData, world: int, rank: int, output_dir: Path,
                    saved: dict | None) -> None:
    """The cheap part of ``ds-trhash preflight``: refuse an output filesystem that cannot hold one
    more checkpoint; log a warning when it cannot hold every checkpoint the run keeps, or when
    the memory estimate does not fit this rank's device (or the host, on CPU)."""
    devices = resources.probe_devices(torch.cuda.current_device() if torch.cuda.is_available() else None)
    local = 1 if devices.kind == "cuda" else resources.local_processes(world)
    existing = [c.step for c in ckpt.list_checkpoints(output_dir) if c.has_manifest] if saved is not None else []
    for warning in resources.check_at_launch(
            cfg, model_cfg, world, local, devices, data.total_steps, getattr(data.batches, "steps_per_epoch", None),
            after=int(saved["step"]) if saved is not None else 0, existing=existing,
            output_free=resources.shared_free_bytes(output_dir)):
        if rank == 0:
            log.warning("%s: %s; %s", warning.name, warning.detail, warning.fix)


def state_recorder(cfg: tcfg.TrainConfig, data: StageData, world: int, critical: dict, init_dir: str | None,
                   model, model_cfg, pack_of: dict[int, int], device: torch.device):
    """The ``trainer_state.json`` builder the checkpointing callback calls: (state, reason, extra) -> dict."""
    hardware = f"{world} process(es); rank 0 on {describe_hardware()}"

    def trainer_state(st: loop.TrainState, reason: str, extra: dict) -> dict:
        return {
            "stage": cfg.stage,
            "family": cfg.model.family,
            "step": st.step,
            "epoch": st.epochs_done,  # epochs completed at this step, as in every other record
            "total_steps": st.total_steps,
            "data_cursor": data.batches.cursor(st.step),
            "tokens_seen": st.tokens_seen,
            "supervised_seen": st.supervised_seen,
            "world_size": world,
            "training_critical": critical,
            "plan_fingerprint": data.plan.fingerprint if data.plan is not None else None,
            "plan_sha256": data.plan.sha256 if data.plan is not None else None,
            "plan_doc": data.plan.doc if data.plan is not None else None,
            "data_source": data.data_source,  # {store, commit}: a resume reads this commit again
            "init_checkpoint": str(init_dir) if init_dir else None,
            "lora": cfg.lora.enabled,
            "backends_used": model.backends_used(),  # the checkpointing callback passes the training step's
            "model_config": model_cfg.to_dict(),
            "tokenizer_dir": data.tokenizer_dir,
            "tokenizer_sha256": data.tokenizer_sha256,
            "tokenizer_assumed": data.tokenizer_assumed,  # the data recorded none: data.tokenizer was taken
            "sft_dir": data.sft_dir,
            "sft_manifest_sha256": data.sft_manifest_sha256,
            "source_stage": cfg.source_stage,
            "hardware": hardware,
            "pack_index": pack_of.get(st.step),
            "packs": len(pack_of) or None,
            "reason": reason,
            "save_started_unix": time.time(),  # the save took until MANIFEST.json appeared (ds-trhash smoke)
            "peak_memory": resources.peak_memory(device),
            **extra,
        }

    return trainer_state


# ----------------------------------------------------------------------------- the stage


@dataclass
class OutputSide:
    """What the command line and the output directory decided, before anything was written."""

    resume_dir: object | None  # CheckpointInfo
    saved: dict | None  # its trainer_state.json
    init_dir: str | None
    damaged: list  # (name, why) of checkpoints set aside by --allow-fresh-over-damaged


def requested_resume(args) -> str | None:
    """``--resume`` or else ``RESUME`` ("auto", a checkpoint directory), None for neither."""
    return args.resume or os.environ.get("RESUME") or None


def check_output_side(cfg: tcfg.TrainConfig, args, rank: int) -> OutputSide:
    """Refusals that need only the command line and the output directory. The launcher runs
    them before the process group exists (a refused launch fails in its first seconds), and
    nothing is written until all of them and the data checks pass."""
    output_dir = Path(cfg.output_dir)
    say = log.info if rank == 0 else (lambda *_: None)
    resume_choice = requested_resume(args)
    damaged: list = []
    if args.resume and os.environ.get("RESUME") and args.resume != os.environ.get("RESUME"):
        ckpt.resolve_resume(args.resume, os.environ.get("RESUME"), output_dir)  # refuses the disagreement
    if resume_choice == "auto":
        resume_dir, damaged = launch_checks.resume_auto(output_dir, args.allow_fresh_over_damaged, log=say)
    else:
        resume_dir = ckpt.resolve_resume(args.resume, os.environ.get("RESUME"), output_dir, log=say)
    if resume_dir is not None and resume_choice != "auto":
        launch_checks.check_resume_source(resume_dir.path, output_dir, args.fork)
    saved = ckpt.read_trainer_state(resume_dir) if resume_dir else None
    init_dir = launch_checks.resolve_init_checkpoint(args.init_checkpoint, log=say)
    if saved is not None and init_dir is None:
        init_dir = saved.get("init_checkpoint")
    if not damaged:
        ckpt.check_output_dir_stage(output_dir, cfg.stage)
    if saved is None and resume_choice is None:
        launch_checks.check_fresh_output_dir(output_dir)
    launch_checks.probe_writable(output_dir)
    return OutputSide(resume_dir, saved, init_dir, damaged)


def check_resume(cfg: tcfg.TrainConfig, args, world: int, data: StageData, saved: dict, resume_dir) -> bool:
    """An exact resume continues the saved run: every training-critical setting, the world size
    (unless --reshard), the plan file, the saved parts, the SFT set. True when it reshards."""
    ckpt.check_resume_compatible(
        saved, tcfg.training_critical(cfg, world), world_size=world, lora_enabled=cfg.lora.enabled,
        total_steps=data.total_steps, stage=cfg.stage, reshard=args.reshard,
        plan_sha256=data.plan.sha256 if data.plan is not None else None,
        found=ckpt.inspect_saved_parts(resume_dir), finished_ok=requested_resume(args) == "auto",
    )
    launch_checks.check_sft_manifest_unchanged(saved.get("sft_manifest_sha256"), data.sft_manifest_sha256, data.sft_dir)
    return ckpt.is_reshard(saved, world, args.reshard)


def run_stage(cfg: tcfg.TrainConfig, args, rank: int, world: int,
              parts: Sequence[type[Callback]] | None = None, checked: OutputSide | None = None) -> loop.TrainState:
    """Train one stage. ``parts``: the callback classes of this launch in call order (the entry
    point composes them, evaluation included); default ``training_parts()``, without evaluation.
    ``checked``: what ``check_output_side`` decided before the process group existed."""

    tcfg.require_source_stage(cfg)
    check_runnable(cfg, world)
    loaded, cfg = cfg, tcfg.for_world(cfg, world)  # batch.grad_accum derived for this world size
    output_dir = Path(cfg.output_dir)
    model_cfg = tcfg.model_config(cfg)

    pre = checked if checked is not None else check_output_side(cfg, args, rank)
    resume_dir, saved, init_dir, damaged = pre.resume_dir, pre.saved, pre.init_dir, pre.damaged
    say = log.info if rank == 0 else (lambda *_: None)

    # --- the data: plan, budgets, tokenizer identity, every shard's hash (reads only; the
    # embedded demo corpus is built once into its own content-named folder, shared by runs)
    data = (prepare_sft_data(cfg, model_cfg, rank, world) if cfg.data.kind == "sft"
            else prepare_pretrain_data(cfg, rank, world, saved_source=(saved or {}).get("data_source")))
    for note in data.notes:
        say(note)
    guard_stage(cfg, init_dir, data, resuming=saved is not None)
    # every callback checks its own inputs now (a malformed PIQA file fails here, before the model)
    builders = build_callbacks(list(parts) if parts is not None else training_parts(), cfg)
    critical = tcfg.training_critical(cfg, world)
    resharding = False  # --reshard onto another world size: universal load, re-seeded RNG
    if saved is not None:
        resharding = check_resume(cfg, args, world, data, saved, resume_dir)
    check_resources(cfg, model_cfg, data, world, rank, output_dir, saved)

    # --- every check passed: from here on the launch writes
    if damaged:
        if rank == 0:
            launch_checks.set_aside_damaged(output_dir, time.strftime("%Y%m%dT%H%M%S"), log=say)
        _barrier()
    if data.start is not None:
        data.start()

    # --- model and engine
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(cfg, model_cfg, init_dir if saved is None else None, device, rank)
    ds_config = tcfg.to_deepspeed_dict(cfg, world)
    engine = build_engine(model, cfg, ds_config, data.total_steps,
                          load_universal=resharding and ckpt.needs_universal(resume_dir))
    state = loop.TrainState(step=0, total_steps=data.total_steps)
    if saved is not None:
        ckpt.load_engine_state(engine.engine, resume_dir, reshard=resharding, output_dir=output_dir,
                               rank=rank, barrier=_barrier, log=log.info)
        state.step = int(saved["step"])
        state.tokens_seen = int(saved.get("tokens_seen", 0))
        state.supervised_seen = int(saved.get("supervised_seen", 0))
        if resharding:
            ckpt.reseed_rng_for_reshard(cfg.seed, state.step, rank)
            if rank == 0:
                log.warning(ckpt.reshard_report(saved, critical, world))
        else:
            restore_rng_state(load_rng_state(resume_dir, rank))

    # --- pluggable parts
    progress = Progress(cfg.stage, data.total_steps, rank, every=cfg.training.log_every, start_step=state.step)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(tcfg.dump_config(loaded), indent=2))
        progress.message(
            f"{cfg.stage}: {cfg.model.preset} on {world} process(es), {data.describe}, "
            f"{data.total_steps} optimizer steps"
            + (f", resuming at step {state.step} from {resume_dir}" if saved is not None else ""))
        if saved is not None and state.step == state.total_steps:
            progress.message(f"resume auto: {cfg.stage} already finished at step {state.step} of {state.total_steps}; "
                             "nothing is left to train (end-of-stage records missing from an interrupted end are "
                             "completed), exiting 0")
        progress.message(startup_summary(
            cfg, tcfg.batch_layout(loaded, world), model=model, total_steps=data.total_steps, start_step=state.step,
            ds_config=ds_config, optimizer=optimizer_name(engine.optimizer, cfg.optimizer),
            kernels=getattr(model, "kernels_requested", None), hardware=describe_hardware(),
            checkpointed_layers=[i for i, layer in enumerate(model.layers) if layer.checkpointed]))
    monitor = MonitorSink(getattr(engine.engine, "monitor", None))  # DeepSpeed's monitors, when configured
    # a fresh start drops rows an earlier attempt logged without leaving a checkpoint (RESUME=auto)
    first_step = state.step if saved is not None else -1
    writer = MetricsWriter(output_dir / METRICS_FILE, rank, resume_step=first_step, on_row=monitor.row)
    model.track_expert_load = True  # counted on the device; read at logged steps only
    expert_load = ExpertLoadWriter(output_dir / EXPERT_LOAD_FILE, model_cfg.num_experts, rank, resume_step=first_step)

    plan = checkpoint_plan(cfg, data)
    trainer_state = state_recorder(cfg, data, world, critical, init_dir, model, model_cfg, dict(plan.pack_of), device)

    # Signals were recorded since the launcher started (callbacks.stop.install); from here on
    # every rank asks once per step whether any rank wants to stop.
    stop = StopAgreement(install_stop_handlers(), LauncherWatch.for_this_process(), world)
    run = RunContext(
        cfg=cfg, rank=rank, world=world, output_dir=output_dir, device=device, engine=engine.engine,
        model=model, model_config=model_cfg, batches=data.batches, progress=progress, writer=writer,
        trainer_state=trainer_state, eval_batches=data.eval_batches, tokenizer_dir=data.tokenizer_dir,
        protect_steps=set(plan.protect), stop=stop, faults=FaultInjection.from_env(), barrier=_barrier, monitor=monitor,
        expert_load=expert_load)
    state = loop.run(engine.engine, data.batches, state, make_callbacks(builders, run), device, world,
                     lr_of=lambda: engine.optimizer.param_groups[0]["lr"], vocab_size=model_cfg.vocab_size)
    writer.close()
    expert_load.close()
    cache = getattr(getattr(data.batches, "reader", None), "cache", None)
    if cache is not None:
        cache.close()
    if rank == 0:
        progress.message(f"{cfg.stage} finished at step {state.step}/{state.total_steps}")
    return state
