"""One launch of one stage: config → data → stage guard → model → engine → loop.

Everything that can refuse a launch (config, data manifests, plan identity, stage transition,
resume compatibility) runs before the model is allocated, so a wrong launch costs seconds and
writes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_trhash import checkpoints as ckpt
from ds_trhash.checkpoints.rng import RNGStateError, load_rng_state, restore_rng_state
from ds_trhash.checkpoints.stages import SourceRecord, StageError, check_launch
from ds_trhash.data.budget import BudgetError, check_target_tokens, pack_boundaries, plan_steps
from ds_trhash.data.cache import CacheError, ShardCache, cache_bytes_from
from ds_trhash.data.embedded import EmbeddedError, build_embedded
from ds_trhash.data.plan import PlanError, load_plan, unique_core_fingerprint, validate_refinement
from ds_trhash.data.reader import ReaderError, ReplayReader, source_manifests
from ds_trhash.data.sft_build import SFTBuildError, build_sft_dataset
from ds_trhash.data.sft_dataset import SFTBatches, SFTDataError, open_sft, pack
from ds_trhash.data.shards import ShardError
from ds_trhash.data.tokenizer import TokenizerError, tokenizer_sha256
from ds_trhash.model import TRHashConfig, TRHashForCausalLM, backend, selfcheck
from ds_trhash.model.backend import BackendError
from ds_trhash.model.compile import compile_model
from ds_trhash.model.lora import LoRAError, apply_lora
from ds_trhash.model.routing import RouteTableError
from ds_trhash.training import config as tcfg
from ds_trhash.training import loop
from ds_trhash.training.batches import PretrainBatches, SFTStepBatches
from ds_trhash.training.callbacks import (
    Callback,
    FaultInjection,
    GracefulStop,
    RunContext,
    build_callbacks,
    make_callbacks,
    training_parts,
)
from ds_trhash.training.engine import (build_engine, check_runnable, compute_dtype, describe_hardware,
                                      expert_parallel_group)
from ds_trhash.training.metrics import MetricsError, MetricsWriter
from ds_trhash.training.progress import Progress

log = logging.getLogger("ds_trhash.trainer")


# Errors that describe a wrong launch (bad data, config, checkpoint): the launcher prints them
# as one line and exits 2 instead of a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    PlanError, SFTDataError, BackendError, RouteTableError, FileNotFoundError, loop.LabelError, BudgetError,
    CacheError, EmbeddedError, ReaderError, ShardError, SFTBuildError, TokenizerError, LoRAError, MetricsError,
    RNGStateError)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank0_first(rank: int, fn):
    """Run ``fn`` on rank 0 first, then on the others: shared on-disk builds (demo corpus) are
    made once and only read by the other ranks."""
    result = fn() if rank == 0 else None
    _barrier()
    if rank != 0:
        result = fn()
    return result


# ----------------------------------------------------------------------------- data


@dataclass
class StageData:
    batches: object  # loop.StepBatches
    total_steps: int
    plan: object | None = None  # ReplayPlan (pretraining, refinement)
    eval_batches: object | None = None  # SFTBatches over the eval partition
    tokenizer_dir: str | None = None
    tokenizer_sha256: str | None = None  # identity of the tokenizer the data was made with
    sft_dir: str | None = None  # the resolved SFT set (the embedded one when the config says null)
    describe: str = ""


def _embedded_root(cfg: tcfg.TrainConfig) -> Path:
    return Path(cfg.output_dir).resolve().parent / "embedded"


def _embedded(cfg: tcfg.TrainConfig, rank: int):
    if cfg.model.preset != "tiny":
        raise tcfg.ConfigError(cfg.origin, "data.plan" if cfg.data.kind == "pretrain" else "data.sft_dir",
                               "required for the 200m preset (the embedded demo corpus is for the tiny preset only)")

    return _rank0_first(rank, lambda: build_embedded(_embedded_root(cfg), seq_len=cfg.data.seq_len))


def _max_steps(cfg: tcfg.TrainConfig, steps: int) -> int:
    return min(steps, cfg.training.max_steps) if cfg.training.max_steps else steps


def prepare_pretrain_data(cfg: tcfg.TrainConfig, rank: int, world: int) -> StageData:
    if cfg.data.plan is None:
        paths = _embedded(cfg, rank)
        plan_path = paths.refine_plan if cfg.stage == "refinement" else paths.pretrain_plan
        shards_dir, tokenizer_dir = paths.shards_dir, paths.tokenizer_dir
    else:
        plan_path, shards_dir, tokenizer_dir = cfg.data.plan, cfg.data.shards_dir, cfg.data.tokenizer
        if shards_dir is None:
            raise tcfg.ConfigError(cfg.origin, "data.shards_dir", "required when data.plan is set")
    plan = load_plan(plan_path)
    if plan.seq_len != cfg.data.seq_len:
        raise tcfg.ConfigError(cfg.origin, "data.seq_len",
                               f"{cfg.data.seq_len} differs from the plan's seq_len {plan.seq_len} ({plan_path})")
    env_target = os.environ.get("TARGET_TOKENS")
    check_target_tokens(plan.doc, env_target if env_target not in (None, "") else cfg.data.target_tokens)
    steps = plan_steps(plan, tcfg.tokens_per_step(cfg, world), requested_steps=cfg.training.max_steps)

    # Every shard is read through the bounded cache, which verifies its SHA-256 against the
    # manifest before a single row is trained on (one cache folder per rank).
    cache_dir = Path(cfg.data.cache_dir or Path(cfg.output_dir) / "shard_cache") / f"rank_{rank}"
    cache = ShardCache(shards_dir, cache_dir, cache_bytes_from(cfg.data.cache_gb, os.environ),
                       source_manifests(shards_dir, plan))
    reader = ReplayReader(plan, shards_dir, cfg.seed, cache=cache)
    batches = PretrainBatches(reader, cfg.batch.micro_batch, cfg.batch.grad_accum, rank, world)
    return StageData(batches=batches, total_steps=_max_steps(cfg, steps), plan=plan,
                     tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                     tokenizer_sha256=plan.doc.get("tokenizer_sha256"),
                     describe=f"plan {plan_path} fingerprint {plan.fingerprint[:12]}")


def prepare_sft_data(cfg: tcfg.TrainConfig, model_cfg, rank: int, world: int) -> StageData:
    sft_dir = cfg.data.sft_dir
    if sft_dir is None:
        paths = _embedded(cfg, rank)

        def build():
            out = Path(paths.root) / "sft"
            if not (out / "manifest.json").exists():
                build_sft_dataset(paths.chat_train_jsonl, paths.chat_eval_jsonl, paths.tokenizer_dir,
                                  cfg.data.seq_len, out, source_name="pydoc_data.topics", revision="python-stdlib")
            return out

        sft_dir = _rank0_first(rank, build)
    tokenizer_hash = None
    if cfg.data.tokenizer:
        tokenizer_hash = tokenizer_sha256(cfg.data.tokenizer)
    data = open_sft(sft_dir, expect_vocab=model_cfg.vocab_size, seq_len=cfg.data.seq_len, tokenizer_hash=tokenizer_hash)
    policy = cfg.data.packing.policy
    train_packs = pack(data.partition("train"), cfg.data.seq_len, policy)
    train = SFTBatches(train_packs, cfg.batch.micro_batch, world, rank, cfg.seed, drop_last=True)
    batches = SFTStepBatches(train, cfg.batch.grad_accum, policy)
    if batches.steps_per_epoch < 1:
        raise SFTDataError(
            f"{train.batches_per_epoch} micro-batches per epoch make no optimizer step with grad_accum "
            f"{cfg.batch.grad_accum}; lower batch.grad_accum or batch.micro_batch")
    eval_batches = None
    if cfg.eval.heldout:
        eval_packs = pack(data.partition("eval"), cfg.data.seq_len, policy)
        eval_batches = SFTBatches(eval_packs, cfg.batch.micro_batch, world, rank, cfg.seed, drop_last=False)
    total = _max_steps(cfg, batches.steps_per_epoch * cfg.training.epochs)
    return StageData(batches=batches, total_steps=total, eval_batches=eval_batches,
                     tokenizer_dir=str(data.tokenizer_path), tokenizer_sha256=data.tokenizer_hash,
                     sft_dir=str(Path(sft_dir).resolve()),
                     describe=f"SFT set {sft_dir}")


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


def check_fresh_output_dir(output_dir: Path) -> None:
    """A fresh start never writes over a run: its checkpoints and metrics would be mixed with
    the new ones. Continuing that run is an explicit --resume."""
    done = [c.name for c in ckpt.list_checkpoints(output_dir) if c.has_manifest]
    if done or (output_dir / "metrics.csv").exists():
        what = f"checkpoints {', '.join(done[-3:])}" if done else "a metrics.csv"
        raise ckpt.CheckpointError(
            f"{output_dir} already holds a run ({what}); continue it with --resume auto, or start this "
            "launch in a new --output-dir")


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
    if cfg.parallel.ep_size > 1:
        # Full model first (same init / init-checkpoint as ep_size 1), then keep this rank's experts.
        # lazy: expert_parallel imports deepspeed.moe (seconds), needed only when ep_size > 1
        from ds_trhash.model.expert_parallel import enable_expert_parallel

        enable_expert_parallel(model, cfg.parallel.ep_size, group=expert_parallel_group(cfg.parallel.ep_size))
    choice = backend.resolve(cfg.kernels.policy, device, model_cfg, require_liger=cfg.kernels.require_liger)
    # every selected fused kernel runs once against PyTorch on this device before training
    choice = selfcheck.verify(choice, cfg.kernels.policy, device, model_cfg, dtype=compute_dtype(cfg.precision),
                              require_liger=cfg.kernels.require_liger)
    backend.apply(model, choice)
    if rank == 0:
        log.info("kernels requested: %s (%s)", choice.to_dict(), choice.reason)
    compile_model(model, cfg.kernels.compile)  # in place: state-dict names unchanged
    return model.to(device)


# ----------------------------------------------------------------------------- what checkpoints record


def protected_steps(cfg: tcfg.TrainConfig, data: StageData) -> tuple[dict[int, int], set[int]]:
    """(token-pack boundary step -> pack number (1-based), steps rotation never removes: the
    pack boundaries and, for SFT, every epoch end)."""
    pack_of: dict[int, int] = {}
    if cfg.data.kind == "pretrain" and cfg.checkpoint.packs:
        pack_of = {b: i + 1 for i, b in enumerate(pack_boundaries(data.total_steps, cfg.checkpoint.packs))}
    protect = set(pack_of)
    if cfg.data.kind == "sft":
        spe = data.batches.steps_per_epoch
        protect |= {spe * e for e in range(1, cfg.training.epochs + 1) if spe * e <= data.total_steps}
    return pack_of, protect


def state_recorder(cfg: tcfg.TrainConfig, data: StageData, world: int, critical: dict, init_dir: str | None,
                   model, model_cfg, pack_of: dict[int, int]):
    """The ``trainer_state.json`` builder the checkpointing callback calls: (state, reason, extra) -> dict."""
    hardware = f"{world} process(es); rank 0 on {describe_hardware()}"

    def trainer_state(st: loop.TrainState, reason: str, extra: dict) -> dict:
        return {
            "stage": cfg.stage,
            "family": cfg.model.family,
            "step": st.step,
            "epoch": data.batches.epoch_of(st.step) if st.step < st.total_steps else st.epoch,
            "total_steps": st.total_steps,
            "data_cursor": data.batches.cursor(st.step),
            "tokens_seen": st.tokens_seen,
            "supervised_seen": st.supervised_seen,
            "world_size": world,
            "training_critical": critical,
            "plan_fingerprint": data.plan.fingerprint if data.plan is not None else None,
            "plan_sha256": data.plan.sha256 if data.plan is not None else None,
            "plan_doc": data.plan.doc if data.plan is not None else None,
            "init_checkpoint": str(init_dir) if init_dir else None,
            "lora": cfg.lora.enabled,
            "backends_used": model.backends_used(),
            "model_config": model_cfg.to_dict(),
            "tokenizer_dir": data.tokenizer_dir,
            "tokenizer_sha256": data.tokenizer_sha256,
            "sft_dir": data.sft_dir,
            "hardware": hardware,
            "pack_index": pack_of.get(st.step),
            "packs": len(pack_of) or None,
            "reason": reason,
            **extra,
        }

    return trainer_state


# ----------------------------------------------------------------------------- the stage


def run_stage(cfg: tcfg.TrainConfig, args, rank: int, world: int,
              parts: Sequence[type[Callback]] | None = None) -> loop.TrainState:
    """Train one stage. ``parts``: the callback classes of this launch in call order (the entry
    point composes them, evaluation included); default ``training_parts()``, without evaluation."""

    tcfg.require_source_stage(cfg)
    check_runnable(cfg, world)
    output_dir = Path(cfg.output_dir)
    model_cfg = dataclasses.replace(TRHashConfig.from_preset(cfg.model.preset),
                                    loss_chunk_tokens=cfg.kernels.loss_chunk_tokens)

    # --- everything that can refuse the launch, before the model exists
    data = (prepare_sft_data(cfg, model_cfg, rank, world) if cfg.data.kind == "sft"
            else prepare_pretrain_data(cfg, rank, world))
    resume_dir = ckpt.resolve_resume(args.resume, os.environ.get("RESUME"), output_dir)
    saved = ckpt.read_trainer_state(resume_dir) if resume_dir else None
    init_dir = args.init_checkpoint
    if saved is not None and init_dir is None:
        init_dir = saved.get("init_checkpoint")
    ckpt.check_output_dir_stage(output_dir, cfg.stage)
    if saved is None and not args.resume and not os.environ.get("RESUME"):
        check_fresh_output_dir(output_dir)
    guard_stage(cfg, init_dir, data, resuming=saved is not None)
    # every callback checks its own inputs now (a malformed PIQA file fails here, before the model)
    builders = build_callbacks(list(parts) if parts is not None else training_parts(), cfg)
    critical = tcfg.training_critical(cfg)
    resharding = False  # --reshard onto another world size: universal load, re-seeded RNG
    if saved is not None:
        ckpt.check_resume_compatible(
            saved, critical, world_size=world, lora_enabled=cfg.lora.enabled,
            total_steps=data.total_steps, stage=cfg.stage, reshard=args.reshard,
            plan_sha256=data.plan.sha256 if data.plan is not None else None,
            found=ckpt.inspect_saved_parts(resume_dir),
        )
        resharding = ckpt.is_reshard(saved, world, args.reshard)

    # --- model and engine
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(cfg, model_cfg, init_dir if saved is None else None, device, rank)
    engine = build_engine(model, cfg, tcfg.to_deepspeed_dict(cfg, world), data.total_steps,
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
        (output_dir / "config.json").write_text(json.dumps(tcfg.dump_config(cfg), indent=2))
        progress.message(
            f"{cfg.stage}: {cfg.model.preset} on {world} process(es), {data.describe}, "
            f"{data.total_steps} optimizer steps"
            + (f", resuming at step {state.step} from {resume_dir}" if saved is not None else ""))
    writer = MetricsWriter(output_dir / "metrics.csv", rank, resume_step=state.step if saved is not None else None)

    pack_of, protect = protected_steps(cfg, data)
    trainer_state = state_recorder(cfg, data, world, critical, init_dir, model, model_cfg, pack_of)

    with GracefulStop() as stop:
        run = RunContext(
            cfg=cfg, rank=rank, world=world, output_dir=output_dir, device=device, engine=engine.engine,
            model=model, model_config=model_cfg, batches=data.batches, progress=progress, writer=writer,
            trainer_state=trainer_state, eval_batches=data.eval_batches, tokenizer_dir=data.tokenizer_dir,
            protect_steps=protect, stop=stop, faults=FaultInjection.from_env(), barrier=_barrier)
        state = loop.run(engine.engine, data.batches, state, make_callbacks(builders, run), device, world,
                         lr_of=lambda: engine.optimizer.param_groups[0]["lr"], vocab_size=model_cfg.vocab_size)
    cache = getattr(getattr(data.batches, "reader", None), "cache", None)
    if cache is not None:
        cache.close()
    if rank == 0:
        progress.message(f"{cfg.stage} finished at step {state.step}/{state.total_steps}")
    return state
