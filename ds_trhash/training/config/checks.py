"""Checks beyond single fields: combinations that cannot run, the device, the source stage.

The combination checks run at load time (from ``reading.config_from_dict``); ``check_device`` and
``require_source_stage`` run at launch, after the CLI had its chance to fill in values.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from ds_trhash.model.config import TRHashConfig
from ds_trhash.training import deepspeed_config as dsc
from ds_trhash.training import global_batch

from .layout import _generated_deepspeed
from .schema import SFT, BatchSection, ConfigError, TrainConfig


class _Builder(Protocol):
    """What these checks use of ``reading._Builder`` (reading imports this module, so by shape):
    an error at a key that names the file or override that set it, and those of related keys."""

    def fail(self, key: str, problem: str, *related: str) -> ConfigError: ...


def _model_facts(preset: str) -> tuple[int, int | None]:
    """(num_experts, max_seq_len) of a preset, from the model package when it is importable."""
    try:
        mc = TRHashConfig.from_preset(preset)
        return int(mc.num_experts), int(getattr(mc, "max_seq_len", 0)) or None
    except (ImportError, AttributeError, ValueError):
        return 4, None  # docs/contracts.md §1: four routed experts in every TR-HASH preset


def _check_combinations(cfg: TrainConfig, b: _Builder) -> None:
    stage = cfg.stage
    if cfg.zero.stage == 3:
        raise b.fail("zero.stage", "DeepSpeed MoE does not support ZeRO-3 (every TR-HASH model is MoE); "
                                   "use 0, 1 or 2")
    if cfg.data.cache_gb is not None and int(cfg.data.cache_gb * 2**30) < 1:
        raise b.fail("data.cache_gb", f"{cfg.data.cache_gb!r} GiB rounds to 0 bytes; the shard cache needs room for "
                                      "at least one shard (the unit is GiB: 0.1 is about 107 MB)")
    if cfg.training.nonfinite == "skip_step" and (cfg.zero.stage != 0 or cfg.precision != "fp32"):
        raise b.fail("training.nonfinite", "skip_step zeroes a step's gradients before the optimizer applies "
                                           "them, which needs zero.stage 0 and precision fp32 (ZeRO keeps its own "
                                           "gradient partitions); use stop, or zero.stage 0 with fp32")
    if stage == SFT and cfg.data.kind != "sft":
        raise b.fail("data.kind", f"stage {SFT} trains on a tokenized SFT set; data.kind must be sft, "
                                  f"got {cfg.data.kind}", "stage")
    if stage != SFT and cfg.data.kind != "pretrain":
        raise b.fail("data.kind", f"stage {stage} trains on token shards and a replay plan; data.kind must be "
                                  f"pretrain, got {cfg.data.kind}", "stage")
    if stage != SFT and cfg.lora.enabled:
        raise b.fail("lora.enabled", f"LoRA exists only for stage {SFT}; stage {stage} is full-parameter", "stage")
    if stage != SFT and cfg.source_stage is not None:
        raise b.fail("source_stage", f"only an {SFT} launch declares a source stage; stage {stage} must leave "
                                     f"it null", "stage")
    if cfg.data.packing.policy == "per_document" and cfg.data.kind != "sft":
        raise b.fail("data.packing.policy", "per_document packing needs example boundaries, which only "
                                            "data.kind sft has; allowed for pretrain: cross_document", "data.kind")
    if stage != SFT and cfg.training.epochs != 1:
        raise b.fail("training.epochs", f"must be 1 for stage {stage}: the replay plan fixes every pass and "
                                        "automatic dataset repetition is forbidden", "stage")
    if stage == SFT and cfg.data.target_tokens is not None:
        raise b.fail("data.target_tokens", "applies to replay plans only; an SFT run is sized by "
                                           "training.epochs (set null)", "stage")
    if stage == SFT and cfg.eval.select == "min_eval_loss" and not cfg.eval.heldout:
        raise b.fail("eval.select", "min_eval_loss picks best/ by held-out loss, which eval.heldout false "
                                    "never computes; set eval.heldout true or eval.select last", "eval.heldout")
    export_final = cfg.training.export_final if cfg.training.export_final is not None else stage != SFT
    if cfg.training.cleanup_after_success != "off" and not export_final:
        raise b.fail("training.cleanup_after_success", "cleanup deletes checkpoints only after a verified final/ "
                                                       "export, which this stage does not write; set "
                                                       "training.export_final true or cleanup_after_success off",
                     "training.export_final")
    if cfg.kernels.require_liger and cfg.kernels.policy == "pytorch":
        raise b.fail("kernels.require_liger", "kernels.policy pytorch never selects Liger; use policy auto "
                                              "or triton, or require_liger false", "kernels.policy")
    if cfg.kernels.compile != "none" and cfg.parallel.ep_size > 1:
        raise b.fail("kernels.compile", "compiling the expert-parallel layers (their all-to-all token exchange) "
                                        "is not supported; use kernels.compile none with parallel.ep_size > 1",
                     "parallel.ep_size")
    if cfg.model.preset != "tiny":
        # null paths mean "the embedded demo corpus", which is sized for the tiny preset only
        # (a null data.shards_dir beside a plan means the plan's own dataset, stage_data.py).
        need = ("data.plan", cfg.data.plan) if cfg.data.kind == "pretrain" else ("data.sft_dir", cfg.data.sft_dir)
        if need[1] is None:
            raise b.fail(need[0], f"required for preset {cfg.model.preset}; null (the embedded demo corpus) "
                                  "is allowed only with preset tiny", "model.preset")
        # data.shards_dir null: the plan's own dataset (an hf://datasets/... repository) is read.
    num_experts, max_seq = _model_facts(cfg.model.preset)
    if num_experts % cfg.parallel.ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise b.fail("parallel.ep_size", f"must divide the {num_experts} routed experts of preset "
                                         f"{cfg.model.preset}; allowed: {', '.join(map(str, divisors))}", "model.preset")
    if max_seq is not None and cfg.data.seq_len > max_seq:
        raise b.fail("data.seq_len", f"{cfg.data.seq_len} exceeds the {max_seq}-token context of preset "
                                     f"{cfg.model.preset}; allowed: 1..{max_seq}", "model.preset")
    sc = cfg.schedule
    if sc.warmup_tokens is not None and sc.warmup_fraction is not None:
        raise b.fail("schedule.warmup_tokens", f"{sc.warmup_tokens} and schedule.warmup_fraction "
                                               f"{sc.warmup_fraction} both size the warmup; keep one of them "
                                               "(set the other null)", "schedule.warmup_fraction")
    bt = cfg.batch
    problem = global_batch.check_static(cfg.data.seq_len, bt.micro_batch, bt.grad_accum, bt.global_tokens)
    if problem:
        raise b.fail(problem[0], problem[1], "batch.global_tokens", "data.seq_len")
    _check_deepspeed_section(cfg, b)


def _check_deepspeed_section(cfg: TrainConfig, b: _Builder) -> None:
    """Owned keys and DeepSpeed's own reading of the merged dict (only when the section is used)."""
    if not cfg.deepspeed:
        return
    for key, problem in dsc.owned_problems(cfg.deepspeed):
        raise b.fail(key, problem)
    # The batch keys do not matter to what is checked here; one micro-batch per step stands in.
    probe = dataclasses.replace(cfg, batch=BatchSection(micro_batch=cfg.batch.micro_batch, grad_accum=1))
    merged = dsc.merge(_generated_deepspeed(probe), cfg.deepspeed)
    problem = dsc.deepspeed_problem(merged, cfg.deepspeed)
    if problem:
        raise b.fail(*problem)

def check_device(cfg: TrainConfig, cuda_available: bool) -> None:
    """What the config asks of a device this machine lacks, refused before any process group."""
    if cfg.precision == "fp16" and not cuda_available:
        raise ConfigError(cfg.origin, "precision",
                          "fp16 needs a CUDA device: DeepSpeed's fp16 loss-scaling optimizer runs on GPUs only, "
                          "and this machine has none; use fp32 (or bf16) on CPU")


def require_source_stage(cfg: TrainConfig) -> str | None:
    """The declared source stage of an SFT launch (docs/contracts.md §3); None for other stages.

    Called by the launcher after the CLI had its chance (``--source-stage`` arrives as
    ``--set source_stage=...``), before any model is built.
    """
    if cfg.stage != SFT:
        return None
    if cfg.source_stage is None:
        raise ConfigError(cfg.origin, "source_stage",
                          f"required for stage {SFT}; set source_stage or pass --source-stage; "
                          "allowed: refinement, supervised-finetuning")
    return cfg.source_stage
