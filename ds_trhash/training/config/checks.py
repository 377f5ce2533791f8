"""Checks beyond single fields: combinations that cannot run, the device, the source stage.

The combination checks run at load time (from ``reading.config_from_dict``); ``check_device`` and
``require_source_stage`` run at launch, after the CLI had its chance to fill in values.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Protocol

from ds_trhash.model.config import ModelSection, ShapeError, TRHashConfig, resolve_shape
from ds_trhash.outputs import OutputPathError, check_dir_target
from ds_trhash.training import deepspeed_config as dsc
from ds_trhash.training import global_batch

from .layout import _generated_deepspeed, as_number
from .schema import SFT, BatchSection, ConfigError, TrainConfig


class _Builder(Protocol):
    """What these checks use of ``reading._Builder`` (reading imports this module, so by shape):
    an error at a key that names the file or override that set it, and those of related keys."""

    def fail(self, key: str, problem: str, *related: str) -> ConfigError: ...


# Token shards store ids as uint16 (ds_trhash.data.shards), so a model can see at most this many.
UINT16_TOKEN_IDS = 2**16


def _model_shape(m: ModelSection, b: _Builder) -> TRHashConfig:
    """The model the config describes, or the refusal naming the model key at fault."""
    try:
        shape = resolve_shape(m.preset, m.shape_overrides())
    except ShapeError as exc:
        raise b.fail(f"model.{exc.field}", exc.problem, *(("model.preset",) if m.preset else ())) from None
    if shape.vocab_size > UINT16_TOKEN_IDS:
        raise b.fail("model.vocab_size", f"{shape.vocab_size} exceeds the {UINT16_TOKEN_IDS} token ids uint16 token "
                                         f"shards hold; allowed: 1..{UINT16_TOKEN_IDS}")
    return shape


def _shape_key(m: ModelSection, name: str) -> str:
    """The key that decided a shape field: the field itself when the config sets it, else the preset."""
    return f"model.{name}" if getattr(m, name) is not None else "model.preset"


def _check_combinations(cfg: TrainConfig, b: _Builder) -> None:
    """Settings that are each valid alone but cannot run together, refused at load time with the
    keys involved; the first problem found is the one raised, so the order of the checks holds."""
    shape = _model_shape(cfg.model, b)
    _check_engine_settings(cfg, b)
    _check_stage_data(cfg, b)
    _check_feature_pairs(cfg, b)
    _check_model_fit(cfg, shape, b)
    _check_schedule_and_batch(cfg, b)
    _check_deepspeed_section(cfg, b)


def _check_engine_settings(cfg: TrainConfig, b: _Builder) -> None:
    """ZeRO stage, shard cache and non-finite handling: what DeepSpeed and the data reader can do."""
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


def _check_stage_data(cfg: TrainConfig, b: _Builder) -> None:
    """What the stage allows: SFT trains on an SFT set (LoRA, a source stage, epochs, best/ by
    held-out loss); every other stage on token shards and a replay plan, full-parameter, one pass."""
    stage = cfg.stage
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


def _check_feature_pairs(cfg: TrainConfig, b: _Builder) -> None:
    """An option that depends on another one being on (or off): cleanup on the final export, Liger
    on a kernel policy that can pick it, compiling on no expert parallelism."""
    if cfg.training.cleanup_after_success != "off" and cfg.training.export_final is False:
        raise b.fail("training.cleanup_after_success", "cleanup deletes checkpoints only after a verified final/ "
                                                       "export, which training.export_final false turns off; set "
                                                       "training.export_final true or cleanup_after_success off",
                     "training.export_final")
    if cfg.kernels.require_liger and cfg.kernels.policy == "pytorch":
        raise b.fail("kernels.require_liger", "kernels.policy pytorch never selects Liger; use policy auto "
                                              "or triton, or require_liger false", "kernels.policy")
    if cfg.kernels.experts == "triton" and cfg.kernels.policy == "pytorch":
        raise b.fail("kernels.experts", "kernels.policy pytorch never runs the Triton experts; use policy auto or "
                                        "triton, or kernels.experts auto, masked or pytorch", "kernels.policy")
    live = cfg.liveness
    if live.silent_s < 5 * live.interval_s:
        raise b.fail("liveness.silent_s", f"{live.silent_s:g} s is less than 5 heartbeats of liveness.interval_s "
                                          f"({live.interval_s:g} s): one late heartbeat would name a live rank lost; "
                                          f"set silent_s >= {5 * live.interval_s:g} or a shorter interval_s",
                     "liveness.interval_s")
    if cfg.kernels.compile != "none" and cfg.parallel.ep_size > 1:
        raise b.fail("kernels.compile", "compiling the expert-parallel layers (their all-to-all token exchange) "
                                        "is not supported; use kernels.compile none with parallel.ep_size > 1",
                     "parallel.ep_size")


def _check_model_fit(cfg: TrainConfig, shape: TRHashConfig, b: _Builder) -> None:
    """The data and the expert parallelism against the model's shape: a corpus sized for it, an
    ep_size that splits its experts evenly, a sequence that fits its context."""
    if cfg.model.preset != "tiny":
        # null paths mean "the embedded demo corpus", which is sized for the tiny preset only
        # (a null data.shards_dir beside a plan means the plan's own dataset, data/stage/opening.py).
        need = ("data.plan", cfg.data.plan) if cfg.data.kind == "pretrain" else ("data.sft_dir", cfg.data.sft_dir)
        if need[1] is None:
            raise b.fail(need[0], f"required for {cfg.model.describe()}; null (the embedded demo corpus) "
                                  "is allowed only with preset tiny", "model.preset")
        # data.shards_dir null: the plan's own dataset (an hf://datasets/... repository) is read.
    num_experts = shape.num_experts
    if num_experts % cfg.parallel.ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise b.fail("parallel.ep_size", f"must divide the {num_experts} routed experts of {cfg.model.describe()}; "
                                         f"allowed: {', '.join(map(str, divisors))}", _shape_key(cfg.model, "num_experts"))
    if cfg.data.seq_len > shape.max_seq_len:
        raise b.fail("data.seq_len", f"{cfg.data.seq_len} exceeds the {shape.max_seq_len}-token context "
                                     f"(positions) of {cfg.model.describe()}; allowed: 1..{shape.max_seq_len}",
                     _shape_key(cfg.model, "max_seq_len"))


def _check_schedule_and_batch(cfg: TrainConfig, b: _Builder) -> None:
    """One way to size the warmup; and a global batch that is wrong whatever the world size is
    refused at load time already, not after a launch has started."""
    sc = cfg.schedule
    if sc.warmup_tokens is not None and sc.warmup_fraction is not None:
        raise b.fail("schedule.warmup_tokens", f"{sc.warmup_tokens} and schedule.warmup_fraction "
                                               f"{sc.warmup_fraction} both size the warmup; keep one of them "
                                               "(set the other null)", "schedule.warmup_fraction")
    bt = cfg.batch
    if bt.micro_batch == "auto":
        if bt.global_tokens is None:
            raise b.fail("batch.micro_batch", "auto chooses among the micro-batches that keep the global batch "
                                              "exact, so it needs batch.global_tokens (tokens per optimizer step); "
                                              "set it, or give batch.micro_batch a number", "batch.global_tokens")
        if bt.grad_accum is not None:
            raise b.fail("batch.micro_batch", f"auto derives batch.grad_accum from the size it chooses; drop "
                                              f"batch.grad_accum ({bt.grad_accum}) or give batch.micro_batch a "
                                              "number", "batch.grad_accum")
    problem = global_batch.check_static(cfg.data.seq_len, as_number(bt.micro_batch),
                                        bt.grad_accum, bt.global_tokens)
    if problem:
        raise b.fail(problem[0], problem[1], "batch.global_tokens", "data.seq_len")


def _check_deepspeed_section(cfg: TrainConfig, b: _Builder) -> None:
    """Owned keys and DeepSpeed's own reading of the merged dict (only when the section is used)."""
    if not cfg.deepspeed:
        return
    for key, problem in dsc.owned_problems(cfg.deepspeed):
        raise b.fail(key, problem)
    # The batch keys do not matter to what is checked here; one micro-batch per step stands in.
    probe = dataclasses.replace(cfg, batch=BatchSection(micro_batch=as_number(cfg.batch.micro_batch), grad_accum=1))
    merged = dsc.merge(_generated_deepspeed(probe), cfg.deepspeed)
    ds_problem = dsc.deepspeed_problem(merged, cfg.deepspeed)
    if ds_problem:
        raise b.fail(*ds_problem)

# The config keys that name a path the launch reads: (key, what kind of path: "... file",
# "directory" or "any", what it names, how to make one). data.shards_dir is a directory unless it is an hf:// repository; null
# keys are not read.
_INPUT_PATHS = (
    ("data.plan", "plan file", "replay plan", "a plan file: `ds-trhash data plan --out PLAN.json`"),
    ("data.shards_dir", "directory", "corpus", "a shard directory (`ds-trhash data tokenize --out`) or "
                                               "hf://datasets/OWNER/REPO"),
    ("data.sft_dir", "directory", "SFT set", "a tokenized SFT set: `ds-trhash sft build --out DIR`"),
    ("data.tokenizer", "any", "tokenizer", "a directory holding tokenizer.json, or the file"),
    ("eval.piqa", "JSONL file", "PIQA set", "a PIQA JSONL file (goal, sol1, sol2, label on each line)"),
)


def _value(cfg: TrainConfig, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _path_problem(path: Path, kind: str, what: str) -> str | None:
    if not path.exists():
        return f"{what} {path} does not exist"
    if kind.endswith("file") and path.is_dir():
        return f"{what} {path} is a directory, not a {kind}"
    if kind == "directory" and not path.is_dir():
        return f"{what} {path} is a file, not a directory"
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        return f"{what} {path} is not readable"
    return None


def check_paths(cfg: TrainConfig) -> None:
    """Every path the config names, checked when the config is (launch and ``ds-trhash preflight``),
    before anything starts: an input that does not exist, or is a file where a directory belongs
    (or the reverse), is refused naming its key; ``data.cache_dir``, which the launch writes, must
    not be a file or lie below one. Whether the contents are right is the data checks' work."""
    for key, kind, what, fix in _INPUT_PATHS:
        value = _value(cfg, key)
        if value is None or (key == "data.shards_dir" and str(value).startswith("hf://")):
            continue
        problem = _path_problem(Path(str(value)), kind, what)
        if problem:
            raise ConfigError(cfg.origin, key, f"{problem}; point {key} at {fix}")
    if cfg.data.cache_dir is not None:
        try:
            check_dir_target("data.cache_dir", cfg.data.cache_dir)
        except OutputPathError as exc:
            raise ConfigError(cfg.origin, "data.cache_dir", f"{exc.message_lines()[0].removeprefix('data.cache_dir ')}; "
                              "it is where the launch keeps its shard cache") from None


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
