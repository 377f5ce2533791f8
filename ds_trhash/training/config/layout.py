"""What a config lays out: the model it trains, and what depends on the world size (the batch
layout, the DeepSpeed dict, the resume-critical keys).

A loaded config is world-size free (``batch.grad_accum`` may still be derived from
``batch.global_tokens``); these functions lay it out on a given number of ranks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, cast

from ds_trhash.batch_layout import step_rows
from ds_trhash.model.config import SHAPE_FIELDS, ModelSection, TRHashConfig, resolve_shape
from ds_trhash.training import deepspeed_config as dsc
from ds_trhash.training import global_batch

from .schema import ConfigError, TrainConfig, _plain

def model_config(cfg: TrainConfig) -> TRHashConfig:
    """The model a launch of ``cfg`` trains: its preset and shape fields (checked at load), with
    the config's loss chunk."""
    shape = resolve_shape(cfg.model.preset, cfg.model.shape_overrides())
    return dataclasses.replace(shape, loss_chunk_tokens=cfg.kernels.loss_chunk_tokens)


def shape_critical(model: ModelSection) -> dict[str, Any]:
    """The architecture fields that differ from the preset (all of them without one), as
    ``model.<field>`` keys: a checkpoint of a preset recorded before shapes were configurable
    has none, and still resumes under the same preset."""
    shape = resolve_shape(model.preset, model.shape_overrides())
    base = None if model.preset is None else resolve_shape(model.preset, {})
    return {f"model.{name}": getattr(shape, name) for name in SHAPE_FIELDS
            if base is None or getattr(shape, name) != getattr(base, name)}


def batch_layout(cfg: TrainConfig, world_size: int) -> global_batch.GlobalBatch:
    """The batch of one optimizer step on ``world_size`` ranks; ConfigError when it cannot split."""
    _check_world(cfg, world_size)
    bt = cfg.batch
    # auto (not chosen yet): the finest layout, micro-batch 1, says whether this world splits the batch at all
    got = global_batch.resolve(cfg.data.seq_len, as_number(bt.micro_batch), bt.grad_accum, bt.global_tokens, world_size)
    if isinstance(got, tuple):
        raise ConfigError(cfg.origin, *got)
    return got


def as_number(micro_batch: int | str) -> int:
    """A micro-batch for a layout check: ``auto`` before it is chosen counts as 1 (every size it
    may choose divides the rows that size 1 splits)."""
    return 1 if isinstance(micro_batch, str) else micro_batch


def micro_batch(cfg: TrainConfig) -> int:
    """``batch.micro_batch`` of a config whose ``auto`` was chosen (``memory.auto``)."""
    if isinstance(cfg.batch.micro_batch, str):
        raise ValueError("batch.micro_batch auto is chosen before the layout is used (memory.auto.resolve)")
    return cfg.batch.micro_batch


def with_micro_batch(cfg: TrainConfig, micro_batch: int) -> TrainConfig:
    """``cfg`` at ``micro_batch`` (auto chosen), grad_accum left to the layout."""
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, micro_batch=micro_batch))


def grad_accum(cfg: TrainConfig) -> int:
    """``batch.grad_accum`` of a config resolved for its world size (``for_world``)."""
    if cfg.batch.grad_accum is None:
        raise ValueError("batch.grad_accum is derived for the world size first (for_world)")
    return cfg.batch.grad_accum


def for_world(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with ``batch.grad_accum`` filled in for ``world_size`` ranks (idempotent)."""
    layout = batch_layout(cfg, world_size)
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, grad_accum=layout.grad_accum))


def tokens_per_step(cfg: TrainConfig, world_size: int) -> int:
    """Token positions per optimizer step (for SFT, the packed capacity, not supervised tokens)."""
    return batch_layout(cfg, world_size).global_tokens


def _check_world(cfg: TrainConfig, world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if world_size % cfg.parallel.ep_size:
        raise ConfigError(cfg.origin, "parallel.ep_size",
                          f"{cfg.parallel.ep_size} does not divide the world size {world_size}; expert "
                          "parallel groups must tile the data-parallel ranks")


def to_deepspeed_dict(cfg: TrainConfig, world_size: int) -> dict:
    """The DeepSpeed config for ``deepspeed.initialize(config=...)``.

    No "optimizer" or "scheduler" entry: the engine passes its own AdamW (torch or FusedAdam per
    ``optimizer.torch_adam``, with the contract's no-decay parameter groups) and the LambdaLR from
    ``schedule.build_scheduler``, which DeepSpeed steps once per optimizer step. Both are on
    DeepSpeed's ZeRO-supported list, so no "zero_allow_untested_optimizer" is needed.
    """
    cfg = for_world(cfg, world_size)
    generated = _generated_deepspeed(cfg)
    generated["train_batch_size"] = step_rows(micro_batch(cfg), grad_accum(cfg), world_size)
    section = dsc.with_monitor_defaults(cfg.deepspeed, f"{cfg.output_dir}", cfg.stage)
    return dsc.merge(generated, section)


def _generated_deepspeed(cfg: TrainConfig) -> dict:
    """Our part of the DeepSpeed config (grad_accum resolved), for one rank: train_batch_size
    still lacks the world-size factor."""
    mb, ga = as_number(cfg.batch.micro_batch), cfg.batch.grad_accum or 1  # for one rank: derived for the world later
    fp16: dict[str, Any] = {"enabled": cfg.precision == "fp16"}
    if cfg.precision == "fp16":
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    bf16: dict[str, Any] = {"enabled": cfg.precision == "bf16"}
    if cfg.precision == "bf16":
        # bf16 has no loss scale to adjust: DeepSpeed's overflow check only tests every gradient
        # tensor for inf/NaN (one check per tensor, a host read) to skip such a step silently.
        # The project's non-finite guard (training/callbacks/nonfinite.py) stops the run or skips the step
        # from the loss and the global gradient norm instead; finite steps are unchanged.
        bf16["check_grad_overflow"] = False
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": ga,
        "train_batch_size": step_rows(mb, ga, 1),
        "gradient_clipping": cfg.optimizer.grad_clip,
        "bf16": bf16,
        "fp16": fp16,
        "zero_optimization": {"stage": cfg.zero.stage},
        # Our Progress display reports; DeepSpeed's own prints would interleave with it.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward and step to time
        # them; the launch times its steps itself (training/throughput.py).
        "timers": {"throughput": {"enabled": False}},
    }


def training_critical(cfg: TrainConfig, world_size: int = 1) -> dict:
    """Settings an exact resume must match (docs/contracts.md §4), as a flat ``{dotted key: value}`` dict.

    Left out on purpose: where things are written or cached (output_dir, cache, checkpoint
    cadence, logging, evaluation, DeepSpeed monitors and profilers) -- they do not change the
    trained trajectory; nor does activation checkpointing (same gradients). LoRA details are
    included only when LoRA is on, so editing an unused default does not block a resume. The
    batch is recorded as laid out on ``world_size`` ranks (grad_accum derived from
    batch.global_tokens), so a resume compares the global batch, not the YAML spelling of it.
    """
    cfg = for_world(cfg, world_size)
    d, o, s = cfg.data, cfg.optimizer, cfg.schedule
    crit: dict[str, Any] = {
        "stage": cfg.stage,
        "source_stage": cfg.source_stage,
        "model.preset": cfg.model.preset,
        "model.family": cfg.model.family,
        **shape_critical(cfg.model),
        "seed": cfg.seed,
        "data.kind": d.kind,
        "data.plan": d.plan,
        "data.sft_dir": d.sft_dir,
        "data.tokenizer": d.tokenizer,
        "data.seq_len": d.seq_len,
        "data.packing.policy": d.packing.policy,
        "data.target_tokens": d.target_tokens,
        "training.epochs": cfg.training.epochs,
        "training.max_steps": cfg.training.max_steps,
        "batch.micro_batch": cfg.batch.micro_batch,
        "batch.grad_accum": cfg.batch.grad_accum,
        "optimizer.lr": o.lr,
        "optimizer.betas": list(o.betas),
        "optimizer.weight_decay": o.weight_decay,
        "optimizer.grad_clip": o.grad_clip,
        "optimizer.eps": o.eps,
        "optimizer.torch_adam": o.torch_adam,
        "schedule.kind": s.kind,
        "schedule.warmup_fraction": s.fraction,
        "schedule.min_warmup_steps": s.min_warmup_steps,
        "schedule.floor": s.floor,
        "precision": cfg.precision,
        "zero.stage": cfg.zero.stage,
        "parallel.ep_size": cfg.parallel.ep_size,
        "kernels.policy": cfg.kernels.policy,
        "kernels.require_liger": cfg.kernels.require_liger,
        "kernels.loss_chunk_tokens": cfg.kernels.loss_chunk_tokens,
        "lora.enabled": cfg.lora.enabled,
    }
    # The newer schedule keys enter only when they change the schedule, so a checkpoint recorded
    # before they existed still resumes under a config that leaves them at their defaults.
    if s.warmup_tokens is not None:
        crit["schedule.warmup_tokens"] = s.warmup_tokens
    if s.warmup_start_factor != 0.0:
        crit["schedule.warmup_start_factor"] = s.warmup_start_factor
    if s.kind == "wsd":
        crit["schedule.stable_fraction"] = s.stable_fraction
    if cfg.lora.enabled:
        crit.update({f"lora.{k}": v for k, v in cast(dict, _plain(cfg.lora)).items() if k != "enabled"})
    crit.update(dsc.critical_items(cfg.deepspeed))
    return crit
