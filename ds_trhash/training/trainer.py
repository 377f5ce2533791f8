"""One launch of one stage: plan → model → engine → restored state → callbacks → loop.

Everything that can refuse a launch (config, data manifests, plan identity, stage transition,
resume compatibility, resources, kernels) is decided by ``training.preparation.plan.plan_launch``
before the model is allocated, so a wrong launch costs seconds and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence

import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.batch_layout import step_rows
from ds_trhash.checkpoints.hardware import describe_hardware
from ds_trhash.checkpoints.rng import load_rng_state, restore_rng_state
from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.model import TRHashForCausalLM, backend
from ds_trhash.model.compile import compile_model
from ds_trhash.model.lora import apply_lora
from ds_trhash.network import describe_network
from ds_trhash.ranks import barrier
from ds_trhash.training import config as tcfg
from ds_trhash.training import liveness, loop
from ds_trhash.training.callbacks import (
    Callback,
    FaultInjection,
    LauncherWatch,
    RunContext,
    StopAgreement,
    make_callbacks,
)
from ds_trhash.training.callbacks.nonfinite import NonFiniteGuard
from ds_trhash.training.display import Progress, data_wait_line
from ds_trhash.training.engine import Engine, build_engine, expert_parallel_group, optimizer_name
from ds_trhash.training.memory.record import read_record
from ds_trhash.training.memory.sizes import fitting_sizes
from ds_trhash.training.preparation import checks as launch_checks
from ds_trhash.training.preparation import resources
from ds_trhash.training.preparation.output import OutputSide
from ds_trhash.training.preparation.plan import LaunchPlan, plan_launch
from ds_trhash.training.preparation.request import LaunchRequest
from ds_trhash.training.records.expert_load import EXPERT_LOAD_FILE, ExpertLoadWriter
from ds_trhash.training.records.files import CONFIG_FILE
from ds_trhash.training.records.metrics_csv import METRICS_FILE, MetricsWriter
from ds_trhash.training.records.monitor import MonitorSink
from ds_trhash.training.signals import StopRequests
from ds_trhash.training.summary import startup_summary

log = logging.getLogger("ds_trhash.trainer")




# ----------------------------------------------------------------------------- the steps of a stage


def build_model(plan: LaunchPlan, rank: int) -> TRHashForCausalLM:
    """The model of the plan on its device: seeded init or the init checkpoint's weights (routes
    kept from the checkpoint), LoRA, activation checkpointing, expert-parallel slicing, the
    planned kernels, compilation."""
    cfg = plan.cfg
    torch.manual_seed(cfg.seed)
    model = TRHashForCausalLM(plan.model_config)
    if plan.initial is not None:  # read and checked by the plan (an SFT→SFT LoRA source arrives merged)
        model.load_checkpoint_state(plan.initial.take(), where=plan.initial.where)
        for line in plan.initial.route_differences:
            log.warning("routes kept from the checkpoint: %s", line)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing, cfg.model.activation_checkpointing_every)
    if cfg.parallel.ep_size > 1:
        # Full model first (same init / init-checkpoint as ep_size 1), then keep this rank's experts.
        # lazy: expert_parallel imports deepspeed.moe (seconds), needed only when ep_size > 1
        from ds_trhash.model.expert_parallel import enable_expert_parallel

        enable_expert_parallel(model, cfg.parallel.ep_size, group=expert_parallel_group(cfg.parallel.ep_size))
    backend.apply(model, plan.kernels)
    if rank == 0:
        log.debug("kernels requested: %s (%s)", plan.kernels.to_dict(), plan.kernels.reason)  # the summary says it
    compile_model(model, cfg.kernels.compile)  # in place: state-dict names unchanged
    return model.to(plan.device)


def start_writing(plan: LaunchPlan, rank: int) -> None:
    """Every check passed: damaged checkpoints are set aside, the data's on-disk parts (the shard
    cache) are created. The first writes of the launch."""
    if plan.output.damaged:
        if rank == 0 and plan.output.resume_dir is None:
            launch_checks.set_aside_damaged(plan.output_dir, time.strftime("%Y%m%dT%H%M%S"), plan.run_files,
                                            log=log.info)
        elif rank == 0:  # --resume auto fell back past them: the run saves those step names again
            launch_checks.set_aside_checkpoints(plan.output_dir, [name for name, _ in plan.output.damaged],
                                                time.strftime("%Y%m%dT%H%M%S"), log=log.info)
        barrier()
    # the stage's first step: the saved one on a resume (``restore``)
    plan.data.loader.open(int(plan.output.saved["step"]) if plan.output.saved is not None else 0)


def restore(plan: LaunchPlan, engine: DeepSpeedEngine, rank: int) -> loop.TrainState:
    """The state the loop starts from: step 0, or the saved run's engine, counters and RNG exactly
    (re-seeded when it reshards onto another world size)."""
    state = loop.TrainState(step=0, total_steps=plan.data.total_steps)
    state.micro_batch = micro_batch_in_force(plan)
    saved, resume_dir = plan.output.saved, plan.output.resume_dir
    if saved is None or resume_dir is None:
        return state
    ckpt.load_engine_state(engine, resume_dir, reshard=plan.resharding, output_dir=plan.output_dir,
                           rank=rank, barrier=barrier, log=log.info)
    state.step = int(saved["step"])
    state.tokens_seen = int(saved.get("tokens_seen", 0))
    state.supervised_seen = int(saved.get("supervised_seen", 0))
    if plan.resharding:
        ckpt.reseed_rng_for_reshard(plan.cfg.seed, state.step, rank)
        if rank == 0:
            log.warning(ckpt.reshard_report(saved, plan.critical, plan.world))
    else:
        restore_rng_state(load_rng_state(resume_dir, rank))
    return state


def micro_batch_in_force(plan: LaunchPlan) -> int | None:
    """The smaller micro-batch an out-of-memory step of an earlier launch of this run recorded
    (``micro_batch.json``), which holds for every launch after it; None: the plan's."""
    record = read_record(plan.output_dir)
    if record is None or record["micro_batch"] >= tcfg.micro_batch(plan.cfg):
        return None
    # the largest size up to the recorded one that divides a rank's rows (another world size after --reshard)
    rank_rows = step_rows(tcfg.micro_batch(plan.cfg), tcfg.grad_accum(plan.cfg), 1)
    return next(d for d in fitting_sizes(rank_rows) if d <= record["micro_batch"])


def announce(plan: LaunchPlan, progress: Progress, model: TRHashForCausalLM, engine: Engine, ds_config: dict,
             state: loop.TrainState) -> None:
    """Rank 0: config.json as loaded, what this launch trains and the start-up summary."""
    cfg, data, world = plan.cfg, plan.data, plan.world
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    (plan.output_dir / CONFIG_FILE).write_text(json.dumps(tcfg.dump_config(plan.loaded), indent=2))
    progress.message(
        f"{cfg.stage}: {cfg.model.describe()} on {world} process(es), {data.describe}, "
        f"{data.total_steps} optimizer steps"
        + (f", resuming at step {state.step} from {plan.output.resume_dir}" if plan.resuming else ""))
    if plan.auto is not None:
        progress.message(plan.auto.describe())
    record = read_record(plan.output_dir)
    if state.micro_batch is not None and record is not None:
        cut = tcfg.micro_batch(plan.cfg)
        progress.message(f"micro-batch {state.micro_batch} in force (grad_accum "
                         f"{step_rows(cut, tcfg.grad_accum(plan.cfg), 1) // state.micro_batch}, the same global "
                         f"batch): an out-of-memory step lowered it from {cut} ({record['events'][-1]['how']}, "
                         "see micro_batch.json)")
    if plan.resuming and state.step == state.total_steps:
        progress.message(f"resume auto: {cfg.stage} already finished at step {state.step} of {state.total_steps}; "
                         "nothing is left to train (end-of-stage records missing from an interrupted end are "
                         "completed), exiting 0")
    progress.message(startup_summary(
        cfg, plan.layout, model=model, total_steps=data.total_steps, start_step=state.step,
        ds_config=ds_config, optimizer=optimizer_name(engine.optimizer, cfg.optimizer),
        kernels=plan.kernels.to_dict(), hardware=describe_hardware(),
        checkpointed_layers=[i for i, layer in enumerate(model.layers) if layer.checkpointed],
        device_type=plan.device.type, network=describe_network(plan.device.type == "cuda")))


def state_recorder(plan: LaunchPlan, model: TRHashForCausalLM) -> Callable[[loop.TrainState, str, dict], dict]:
    """The ``trainer_state.json`` builder the checkpointing callback calls: (state, reason, extra) -> dict."""
    record, data = plan.record(), plan.data

    def trainer_state(st: loop.TrainState, reason: str, extra: dict) -> dict:
        return record.trainer_state(
            step=st.step, epoch=st.epochs_done, total_steps=st.total_steps, data_cursor=data.loader.cursor(st.step),
            tokens_seen=st.tokens_seen, supervised_seen=st.supervised_seen,
            backends_used=model.backends_used(),  # the checkpointing callback passes the training step's
            reason=reason, peak_memory=resources.peak_memory(plan.device),
            extra={"micro_batch_in_force": st.micro_batch or tcfg.micro_batch(plan.cfg), **extra})

    return trainer_state


def run_context(plan: LaunchPlan, rank: int, engine: DeepSpeedEngine, model: TRHashForCausalLM, progress: Progress, state: loop.TrainState,
                requests: StopRequests | None = None) -> RunContext:
    """What the callbacks are built from: the engine and model, the record writers (opened here,
    closed by the metrics callback), the stop agreement, the trainer-state builder."""
    cfg, data, output_dir = plan.cfg, plan.data, plan.output_dir
    monitor = MonitorSink(getattr(engine, "monitor", None))  # DeepSpeed's monitors, when configured
    # a fresh start drops rows an earlier attempt logged without leaving a checkpoint (RESUME=auto)
    first_step = state.step if plan.resuming else -1
    writer = MetricsWriter(output_dir / METRICS_FILE, rank, resume_step=first_step, on_row=monitor.row)
    model.track_expert_load = True  # counted on the device; read at logged steps only
    expert_load = ExpertLoadWriter(output_dir / EXPERT_LOAD_FILE, plan.model_config.num_experts, rank,
                                   resume_step=first_step)
    # Signals were recorded since launch/train.py started (training/signals.py); from here on
    # every rank asks once per step whether any rank wants to stop.
    stop = StopAgreement(requests or StopRequests(), LauncherWatch.for_this_process(), plan.world, data=data.loader)
    return RunContext(
        cfg=cfg, rank=rank, world=plan.world, output_dir=output_dir, device=plan.device, engine=engine,
        model=model, model_config=plan.model_config, loader=data.loader, progress=progress, writer=writer,
        trainer_state=state_recorder(plan, model), eval_batches=data.eval_batches, tokenizer_dir=data.tokenizer_dir,
        protect_steps=set(plan.checkpoints.protect), stop=stop, faults=FaultInjection.from_env(), barrier=barrier,
        monitor=monitor, expert_load=expert_load)


# ----------------------------------------------------------------------------- the stage


def run_stage(cfg: tcfg.TrainConfig, request: LaunchRequest, rank: int, world: int,
              parts: Sequence[type[Callback]] | None = None, checked: OutputSide | None = None,
              on_first_write: Callable[[], None] | None = None,
              requests: StopRequests | None = None) -> loop.TrainState:
    """Train one stage. ``request``: the command line and environment, resolved by the entry
    point (``entrypoint.launch_request``). ``parts``: the callback classes of this launch in call order (the entry
    point composes them, evaluation included); default ``training_parts()``, without evaluation.
    ``checked``: what ``check_output_side`` decided under the run lock. ``on_first_write``: called
    once every check passed, right before the launch's first write (the run lock is kept then).
    ``requests``: the process's stop-signal recorder (``launch/train.py``); None records nothing."""
    plan = plan_launch(cfg, request, rank, world, parts, checked)  # every refusal; writes nothing
    if on_first_write is not None:
        on_first_write()
    try:
        start_writing(plan, rank)
        return _train_stage(plan, rank, world, requests)
    finally:  # every way out (the end, a stop, an error): the data's thread and shard cache closed
        plan.data.loader.close()


def _train_stage(plan: LaunchPlan, rank: int, world: int, requests: StopRequests | None) -> loop.TrainState:
    """The stage once its data is open: model, engine, restored state, callbacks, the loop."""
    cfg, data = plan.cfg, plan.data
    model = build_model(plan, rank)
    ds_config = tcfg.to_deepspeed_dict(cfg, world)
    engine = build_engine(model, cfg, ds_config, data.total_steps,
                          load_universal=plan.resharding and plan.output.resume_dir is not None
                          and ckpt.needs_universal(plan.output.resume_dir, cfg.parallel.ep_size))
    state = restore(plan, engine.engine, rank)
    # heard from while it still starts: at the step it continues from, not at 0 (a resumed run)
    liveness.current().beacon.step = state.step

    progress = Progress(cfg.stage, data.total_steps, rank, every=cfg.training.log_every, start_step=state.step)
    if rank == 0:
        announce(plan, progress, model, engine, ds_config, state)
    run = run_context(plan, rank, engine.engine, model, progress, state, requests)
    # the callbacks close the records and the display, even when a step raises
    callbacks = make_callbacks(list(plan.builders), run)
    state = loop.run(engine.engine, data.loader, state, callbacks, plan.device, world, faults=run.faults,
                     lr_of=lambda: engine.optimizer.param_groups[0]["lr"], vocab_size=plan.model_config.vocab_size,
                     beacon=liveness.current().beacon)
    if rank == 0:
        skipped = "".join(cb.describe() for cb in callbacks if isinstance(cb, NonFiniteGuard))
        progress.message(f"{cfg.stage} finished at step {state.step}/{state.total_steps}{skipped}")
        wait = data_wait_line(data.loader.figures(), state.step_seconds, state.steps_timed)
        for line in (wait, state.throughput.describe()):
            if line:
                progress.message(line)
    return state
