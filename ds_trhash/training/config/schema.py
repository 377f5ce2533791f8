"""The config schema: section dataclasses (field names are the YAML keys) and their value checks.

Each field may carry a ``check`` in its metadata; the reader (``reading.py``) runs it on the value
after the type is right, so a range problem is reported with the file and dotted key like any other.
Key reference: ``docs/configs.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, Literal

from ds_trhash.errors import UserError
from ds_trhash.model.backend import POLICIES as KERNEL_POLICIES
from ds_trhash.model.config import SHAPE_FIELDS
from ds_trhash.model.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS

STAGES = ("pretraining", "refinement", "supervised-finetuning")
SFT = "supervised-finetuning"
# docs/contracts.md §6: W = int(0.03 * H) unless a config says otherwise.
DEFAULT_WARMUP_FRACTION = 0.03
# LoRA targets (LORA_TARGETS, DEFAULT_LORA_TARGETS) come from ds_trhash.model.lora; stacked expert
# weights are switched by `lora.experts`.


class ConfigError(UserError, ValueError):
    """A configuration that must not be launched; the message is meant for the user as is."""

    def __init__(self, source: str, key: str, problem: str):
        self.source = source
        self.key = key
        self.problem = problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


# --- field checks -------------------------------------------------------------------------
# Each returns a problem string, or None when the value is acceptable.

def _positive(v: float) -> str | None:
    return None if v > 0 else f"must be > 0, got {v!r}"


def _non_negative(v: float) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v!r}"


def _half_open_unit(v: float) -> str | None:
    return None if 0 <= v < 1 else f"must be in [0, 1), got {v!r}"


def _closed_unit(v: float) -> str | None:
    return None if 0 <= v <= 1 else f"must be in [0, 1], got {v!r}"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda v: None if v is None else check(v)


def _betas(v: tuple[float, float]) -> str | None:
    bad = [b for b in v if not 0 <= b < 1]
    return f"each beta must be in [0, 1), got {list(v)}" if bad else None


def _lora_targets(v: tuple[str, ...]) -> str | None:
    if not v:
        return f"must name at least one layer; allowed: {', '.join(LORA_TARGETS)}"
    unknown = [t for t in v if t not in LORA_TARGETS]
    if unknown:
        return f"unknown target(s) {unknown}; allowed: {', '.join(LORA_TARGETS)}"
    if len(set(v)) != len(v):
        return f"duplicate targets in {list(v)}"
    return None


def _seed(v: int) -> str | None:
    # Every RNG seeded from it (torch, numpy PCG64, DeepSpeed) takes an unsigned 64-bit value.
    return None if 0 <= v < 2**64 else f"must fit an unsigned 64-bit integer (0 <= seed < 2**64), got {v}"


def _f(default: Any = MISSING, *, check: Callable[[Any], str | None] | None = None,
       factory: Callable[[], Any] | None = None) -> Any:
    meta = {"check": check} if check else {}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --- schema ----------------------------------------------------------------------------------

_SHAPE = _optional(_positive)


@dataclass(frozen=True)
class ModelSection:
    # A named size, or null with the architecture below given field by field; a preset plus some
    # of those fields is the preset with them replaced (ds_trhash.model.config.resolve_shape).
    preset: Literal["200m", "tiny"] | None = None
    # "vision" integrates refinement in its own recipe, so the stage guard lets it go
    # pretraining -> SFT directly.
    family: Literal["language", "vision"] = "language"
    # Recompute decoder layers in backward instead of keeping their activations: none, every
    # layer (full) or every activation_checkpointing_every-th layer (every_n). Same gradients.
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    activation_checkpointing_every: int = _f(2, check=_positive)
    # The architecture, under the model's own field names (model.config.SHAPE_FIELDS); null: the
    # preset's value. Combinations are checked at load (checks.py).
    vocab_size: int | None = _f(None, check=_SHAPE)
    hidden_size: int | None = _f(None, check=_SHAPE)
    num_layers: int | None = _f(None, check=_SHAPE)
    num_heads: int | None = _f(None, check=_SHAPE)
    num_kv_heads: int | None = _f(None, check=_SHAPE)
    head_dim: int | None = _f(None, check=_SHAPE)
    shared_width: int | None = _f(None, check=_SHAPE)
    num_experts: int | None = _f(None, check=_SHAPE)
    expert_width: int | None = _f(None, check=_SHAPE)
    max_seq_len: int | None = _f(None, check=_SHAPE)
    hash_channels: int | None = _f(None, check=_SHAPE)
    route_seed: int | None = _f(None, check=_optional(_non_negative))

    def shape_overrides(self) -> dict[str, int]:
        """The architecture fields this section sets (the rest come from the preset)."""
        return {name: getattr(self, name) for name in SHAPE_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class PackingSection:
    policy: Literal["cross_document", "per_document"] = "cross_document"


@dataclass(frozen=True)
class DataSection:
    kind: Literal["pretrain", "sft"] = "pretrain"
    plan: str | None = None
    shards_dir: str | None = None
    cache_dir: str | None = None
    cache_gb: float = _f(1.0, check=_positive)
    # How long a Hub store waits out an outage (503s, 429s, no connection) before the run stops with
    # a checkpoint: each wait is one line, Retry-After and rate limits are honoured.
    hub_wait_minutes: float = _f(30.0, check=_positive)
    # How far ahead, in time at the measured pace, the cache fetches the shards the plan reads next
    # (two at a time per rank, held until read); 0 looks only at the next shuffle window.
    prefetch_minutes: float = _f(10.0, check=_non_negative)
    # On several nodes reading the Hub: the global rows whose exchange between the nodes is one
    # collective (rounded down to whole steps, at least one step).
    exchange_rows: int = _f(4096, check=_positive)
    # A cache folder on a network filesystem (nfs, lustre, gpfs, cifs, fuse) is refused unless this
    # says its locks work and only one node uses it.
    cache_on_network_fs: bool = False
    sft_dir: str | None = None
    tokenizer: str | None = None
    seq_len: int = _f(2048, check=_positive)
    packing: PackingSection = _f(factory=PackingSection)
    target_tokens: int | None = _f(None, check=_optional(_positive))


@dataclass(frozen=True)
class OptimizerSection:
    lr: float = _f(2.0e-5, check=_positive)
    betas: tuple[float, float] = _f((0.9, 0.95), check=_betas)
    weight_decay: float = _f(0.1, check=_non_negative)
    grad_clip: float = _f(1.0, check=_non_negative)
    eps: float = _f(1.0e-8, check=_positive)
    # True: torch.optim.AdamW (fused kernel on CUDA). False: DeepSpeed's FusedAdam on CUDA; on CPU,
    # where FusedAdam does not exist, torch AdamW again (the startup summary says which ran).
    torch_adam: bool = True


@dataclass(frozen=True)
class ScheduleSection:
    # cosine: warmup then one cosine to the floor; wsd: warmup, a stable peak, then a cosine over the
    # last (1 - stable_fraction) of the post-warmup steps (ds_trhash.training.schedule).
    kind: Literal["cosine", "wsd"] = "cosine"
    # W = int(fraction * H); null means DEFAULT_WARMUP_FRACTION unless warmup_tokens is set.
    warmup_fraction: float | None = _f(None, check=_optional(_half_open_unit))
    # The warmup in tokens instead: W = ceil(warmup_tokens / tokens per step). Exclusive with
    # warmup_fraction (checks.py), so a dumped config (both keys written) loads back.
    warmup_tokens: int | None = _f(None, check=_optional(_positive))
    # LR factor the warmup line starts from (0: the first step is at peak / W).
    warmup_start_factor: float = _f(0.0, check=_half_open_unit)
    stable_fraction: float = _f(0.8, check=_half_open_unit)
    min_warmup_steps: int = _f(1, check=_non_negative)
    floor: float = _f(0.1, check=_closed_unit)

    @property
    def fraction(self) -> float | None:
        """The warmup fraction in force: None when the warmup is given in tokens."""
        if self.warmup_tokens is not None:
            return None
        return DEFAULT_WARMUP_FRACTION if self.warmup_fraction is None else self.warmup_fraction


def _positive_or_auto(v: int | str) -> str | None:
    return None if v == "auto" else _positive(v)


@dataclass(frozen=True)
class BatchSection:
    # rows per forward on one rank; "auto": the largest size that fits the device's memory (a probe
    # on CUDA, the estimate against auto_budget_gb on CPU) among those that keep global_tokens exact
    # (training/memory/auto.py); a resume takes the size the run recorded
    micro_batch: int | Literal["auto"] = _f(16, check=_positive_or_auto)
    # Derived at launch from global_tokens and the world size when global_tokens is set;
    # without global_tokens the batch is per rank and grad_accum defaults to 1.
    grad_accum: int | None = _f(None, check=_optional(_positive))
    # Tokens per optimizer step over all ranks (see ds_trhash.training.global_batch).
    global_tokens: int | None = _f(None, check=_optional(_positive))
    # micro_batch auto: the share of the device's memory a probed size leaves free (the allocator's
    # fragmentation, evaluation, a longer document mask)
    auto_headroom: float = _f(0.10, check=_half_open_unit)
    # micro_batch auto on CPU (no device memory to measure): the estimate must fit this many GiB
    auto_budget_gb: float = _f(16.0, check=_positive)


@dataclass(frozen=True)
class TrainingSection:
    epochs: int = _f(1, check=_positive)
    max_steps: int | None = _f(None, check=_optional(_positive))
    log_every: int = _f(1, check=_positive)
    # a non-finite loss or gradient norm: stop the run (no checkpoint of it), or skip such steps
    nonfinite: Literal["stop", "skip_step"] = "stop"
    nonfinite_max_skips: int = _f(3, check=_positive)  # skip_step: this many in a row stop the run
    # a completed stage writes <output_dir>/final/ (verified export); null: on for pretraining and
    # refinement, off for SFT (which keeps best/)
    export_final: bool | None = None
    # after a verified final/: delete numbered checkpoints (release/lifecycle/cleanup.py); packs and best/ kept
    # by keep_packs, only final/ and best/ by keep_final
    cleanup_after_success: Literal["keep_final", "keep_packs", "off"] = "off"
    # deterministic GPU kernels (training/determinism.py): a resume repeats the run bit for bit
    deterministic: bool = True


@dataclass(frozen=True)
class ZeroSection:
    stage: Literal[0, 1, 2, 3] = 1


@dataclass(frozen=True)
class KernelsSection:
    policy: Literal[KERNEL_POLICIES] = "auto"
    require_liger: bool = False
    loss_chunk_tokens: int = _f(1024, check=_positive)
    # inductor on the engine path: none, each decoder layer, or the whole model (model/compile.py)
    compile: Literal["none", "layers", "model"] = "none"
    # routed experts: auto (the policy's choice; on CUDA the Triton kernel and the dense masked path
    # timed at the launch's shape, the faster runs: model/expert_probe.py) or one of them fixed
    experts: Literal["auto", "triton", "masked", "pytorch"] = "auto"


@dataclass(frozen=True)
class ParallelSection:
    ep_size: int = _f(1, check=_positive)


@dataclass(frozen=True)
class LoraSection:
    enabled: bool = False
    rank: int = _f(16, check=_positive)
    alpha: float = _f(16.0, check=_positive)
    dropout: float = _f(0.05, check=_half_open_unit)
    targets: tuple[str, ...] = _f(DEFAULT_LORA_TARGETS, check=_lora_targets)
    experts: bool = False


@dataclass(frozen=True)
class CheckpointSection:
    every_steps: int | None = _f(None, check=_optional(_positive))
    keep_last: int | None = _f(3, check=_optional(_positive))
    packs: int | None = _f(40, check=_optional(_positive))
    # a Hub sync runs beside training: rotation deletes only checkpoints it verified on the Hub
    keep_unsynced: bool = False


@dataclass(frozen=True)
class EvalSection:
    heldout: bool = True
    piqa: str | None = None
    # Which epoch checkpoint becomes best/: lowest held-out loss, or simply the last epoch.
    select: Literal["min_eval_loss", "last"] = "min_eval_loss"


def _profile_steps(v: tuple[int, int]) -> str | None:
    first, last = v
    # the profiler warms up in the step before the first one traced
    return None if 2 <= first <= last else (f"must be [first, last] optimizer steps with 2 <= first <= last "
                                            f"(the profiler warms up in step first-1), got {list(v)}; "
                                            f"e.g. --set profile.steps=10,12")


@dataclass(frozen=True)
class ProfileSection:
    # torch.profiler trace of optimizer steps first..last (as the progress line counts them), one
    # Chrome-trace file per rank under <output_dir>/profile (TensorBoard, Perfetto); null: off.
    steps: tuple[int, int] | None = _f(None, check=_optional(_profile_steps))


@dataclass(frozen=True)
class TrainConfig:
    stage: Literal["pretraining", "refinement", "supervised-finetuning"]
    model: ModelSection
    output_dir: str
    data: DataSection = _f(factory=DataSection)
    optimizer: OptimizerSection = _f(factory=OptimizerSection)
    schedule: ScheduleSection = _f(factory=ScheduleSection)
    batch: BatchSection = _f(factory=BatchSection)
    training: TrainingSection = _f(factory=TrainingSection)
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    zero: ZeroSection = _f(factory=ZeroSection)
    kernels: KernelsSection = _f(factory=KernelsSection)
    parallel: ParallelSection = _f(factory=ParallelSection)
    lora: LoraSection = _f(factory=LoraSection)
    checkpoint: CheckpointSection = _f(factory=CheckpointSection)
    eval: EvalSection = _f(factory=EvalSection)
    profile: ProfileSection = _f(factory=ProfileSection)
    seed: int = _f(1234, check=_seed)
    # Passed to DeepSpeed: deep-merged into the generated config (ds_trhash.training.deepspeed_config).
    deepspeed: dict = _f(factory=dict)
    # Checked at launch (require_source_stage), not at load: the CLI may supply it.
    source_stage: Literal["refinement", "supervised-finetuning"] | None = None
    # Where the values came from, for error messages raised after loading; not a YAML key.
    origin: str = field(default="<config>", compare=False, repr=False, metadata={"internal": True})


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("internal")}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def dump_config(cfg: TrainConfig) -> dict:
    """The full config (defaults included) as plain YAML/JSON types; loads back to an equal config."""
    return _plain(cfg)
