"""The config schema: section dataclasses (field names are the YAML keys) and their value checks.

Each field may carry a ``check`` in its metadata; the reader (``reading.py``) runs it on the value
after the type is right, so a range problem is reported with the file and dotted key like any other.
Key reference: ``docs/configs.md``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ds_trhash.config_fields import ConfigError
from ds_trhash.config_fields import half_open_unit as _half_open_unit
from ds_trhash.config_fields import non_negative as _non_negative
from ds_trhash.config_fields import optional as _optional
from ds_trhash.config_fields import positive as _positive
from ds_trhash.config_fields import setting as _f
from ds_trhash.data.config import DataSection, PackingSection  # the data's own section
from ds_trhash.model.backend import KernelsSection  # the kernels' own section, beside the policies
from ds_trhash.model.config import ModelSection  # the model's own section, beside its shapes
from ds_trhash.model.lora import LoraSection  # LoRA's own section, beside its targets
from ds_trhash.training.schedule import ScheduleSection  # the schedule's own section

STAGES = ("pretraining", "refinement", "supervised-finetuning")
SFT = "supervised-finetuning"


def _betas(v: tuple[float, float]) -> str | None:
    bad = [b for b in v if not 0 <= b < 1]
    return f"each beta must be in [0, 1), got {list(v)}" if bad else None


def _seed(v: int) -> str | None:
    # Every RNG seeded from it (torch, numpy PCG64, DeepSpeed) takes an unsigned 64-bit value.
    return None if 0 <= v < 2**64 else f"must fit an unsigned 64-bit integer (0 <= seed < 2**64), got {v}"


# --- schema ----------------------------------------------------------------------------------

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


def _positive_or_auto(v: int | str) -> str | None:
    if isinstance(v, str):
        return None if v == "auto" else f"must be > 0 or auto, got {v!r}"
    return _positive(v)


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
class ParallelSection:
    ep_size: int = _f(1, check=_positive)


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
class LivenessSection:
    # Heartbeats between the ranks beside the collectives (training/liveness/): a rank unheard or
    # stuck past its limit is named by every rank, which then exits 76. null: on with several ranks.
    enabled: bool | None = None
    interval_s: float = _f(1.0, check=_positive)  # one heartbeat per rank and interval
    silent_s: float = _f(30.0, check=_positive)  # a rank unheard this long is lost
    # How long a rank may hold one place while another rank is ahead of it (waiting for it), by
    # what it is doing: a step's compute and hooks, then the long phases with their own limits.
    # The data's wait is data.hub_wait_minutes plus ten minutes.
    stuck_minutes: float = _f(5.0, check=_positive)
    startup_minutes: float = _f(30.0, check=_positive)  # model, engine, checkpoint load or reshard
    first_step_minutes: float = _f(30.0, check=_positive)  # compilation, Triton autotuning, experts probe
    checkpoint_minutes: float = _f(30.0, check=_positive)  # a checkpoint's write, best/, final/ export
    eval_minutes: float = _f(30.0, check=_positive)  # held-out loss, PIQA
    probe_minutes: float = _f(30.0, check=_positive)  # a probe or recompile inside a step


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
    liveness: LivenessSection = _f(factory=LivenessSection)
    seed: int = _f(1234, check=_seed)
    # Passed to DeepSpeed: deep-merged into the generated config (ds_trhash.training.deepspeed_config).
    deepspeed: dict = _f(factory=dict)
    # Checked at launch (require_source_stage), not at load: the CLI may supply it.
    source_stage: Literal["refinement", "supervised-finetuning"] | None = None
    # Where the values came from, for error messages raised after loading; not a YAML key.
    origin: str = field(default="<config>", compare=False, repr=False, metadata={"internal": True})


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("internal")}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def dump_config(cfg: TrainConfig) -> dict:
    """The full config (defaults included) as plain YAML/JSON types; loads back to an equal config."""
    return cast(dict, _plain(cfg))  # a dataclass: its fields as a mapping
