"""Training configuration: YAML -> typed, validated dataclasses.

A launch on many GPUs should fail in the first second, on every rank alike, with a message
that names the file (or ``--set`` override), the dotted key and what would have been
accepted -- not an hour later inside DeepSpeed. So the whole schema is checked when the file
is loaded: unknown keys, types, enum values, ranges and combinations that cannot run. The
one exception is ``source_stage``, which the CLI may still supply after loading; see
:func:`require_source_stage`.

The schema is the dataclasses below; their field names are the YAML keys. Key reference:
``docs/configs.md``.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import yaml

from ds_trhash.model.backend import POLICIES as KERNEL_POLICIES
from ds_trhash.model.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS
from ds_trhash.model.config import TRHashConfig

__all__ = [
    "ConfigError",
    "TrainConfig",
    "ModelSection",
    "DataSection",
    "PackingSection",
    "OptimizerSection",
    "ScheduleSection",
    "BatchSection",
    "TrainingSection",
    "ZeroSection",
    "KernelsSection",
    "ParallelSection",
    "LoraSection",
    "CheckpointSection",
    "EvalSection",
    "STAGES",
    "LORA_TARGETS",
    "load_config",
    "config_from_dict",
    "dump_config",
    "require_source_stage",
    "to_deepspeed_dict",
    "training_critical",
    "tokens_per_step",
]

STAGES = ("pretraining", "refinement", "supervised-finetuning")
SFT = "supervised-finetuning"
# LoRA targets (LORA_TARGETS, DEFAULT_LORA_TARGETS) come from ds_trhash.model.lora; stacked expert
# weights are switched by `lora.experts`.


class ConfigError(ValueError):
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


def _f(default: Any = MISSING, *, check: Callable[[Any], str | None] | None = None,
       factory: Callable[[], Any] | None = None) -> Any:
    meta = {"check": check} if check else {}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --- schema ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSection:
    preset: Literal["200m", "tiny"]
    # "vision" integrates refinement in its own recipe, so the stage guard lets it go
    # pretraining -> SFT directly.
    family: Literal["language", "vision"] = "language"


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
    # True: torch.optim.AdamW; False: DeepSpeed FusedAdam (CUDA build needed). Same update rule.
    torch_adam: bool = True


@dataclass(frozen=True)
class ScheduleSection:
    kind: Literal["cosine"] = "cosine"
    warmup_fraction: float = _f(0.03, check=_half_open_unit)
    min_warmup_steps: int = _f(1, check=_non_negative)
    floor: float = _f(0.1, check=_closed_unit)


@dataclass(frozen=True)
class BatchSection:
    micro_batch: int = _f(16, check=_positive)
    grad_accum: int = _f(1, check=_positive)


@dataclass(frozen=True)
class TrainingSection:
    epochs: int = _f(1, check=_positive)
    max_steps: int | None = _f(None, check=_optional(_positive))
    log_every: int = _f(1, check=_positive)
    eval_every_epoch: bool = True


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


@dataclass(frozen=True)
class EvalSection:
    heldout: bool = True
    piqa: str | None = None
    # Which epoch checkpoint becomes best/: lowest held-out loss, or simply the last epoch.
    select: Literal["min_eval_loss", "last"] = "min_eval_loss"


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
    seed: int = 1234
    # Checked at launch (require_source_stage), not at load: the CLI may supply it.
    source_stage: Literal["refinement", "supervised-finetuning"] | None = None
    # Where the values came from, for error messages raised after loading; not a YAML key.
    origin: str = field(default="<config>", compare=False, repr=False, metadata={"internal": True})


# --- YAML reading ----------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``3e-4`` as a float.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so ``lr: 3e-4``
    would silently be the string "3e-4". Learning rates are written that way all the time.
    """


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass


def _schema_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return f"a list of {len(args)} {_type_name(args[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


class _Builder:
    """Turns a nested mapping into TrainConfig, remembering where each key was set."""

    def __init__(self, source: str, key_sources: Mapping[str, str]):
        self.source = source
        self.key_sources = dict(key_sources)

    def where(self, key: str) -> str:
        """The override that set ``key`` (or a section above it), else the file."""
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            hit = self.key_sources.get(".".join(parts[:i]))
            if hit:
                return hit
        return self.source

    def fail(self, key: str, problem: str, *related: str) -> ConfigError:
        """An error at ``key``; ``related`` keys of a combination add their sources when they differ."""
        sources: list[str] = []
        for k in (key, *related):
            if self.where(k) not in sources:
                sources.append(self.where(k))
        return ConfigError(" + ".join(sources), key, problem)

    def build(self, cls: type, raw: Any, prefix: str) -> Any:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise self.fail(prefix or "<top level>", f"expected a mapping, got {type(raw).__name__} {raw!r}")
        fields = _schema_fields(cls)
        hints = _hints(cls)
        for key in raw:
            if key not in fields:
                full = f"{prefix}.{key}" if prefix else str(key)
                raise self.fail(full, f"unknown key; allowed keys: {', '.join(sorted(fields))}")
        values = {}
        for name, f in fields.items():
            full = f"{prefix}.{name}" if prefix else name
            tp = hints[name]
            if name in raw:
                value = self.convert(tp, raw[name], full)
            elif dataclasses.is_dataclass(tp):
                value = self.build(tp, {}, full)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise self.fail(full, f"missing required field; expected {_type_name(tp)}")
            else:
                continue
            check = f.metadata.get("check")
            problem = check(value) if check else None
            if problem:
                raise self.fail(full, problem)
            values[name] = value
        return cls(**values)

    def convert(self, tp: Any, value: Any, key: str, nullable: bool = False) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        orr = " or null" if nullable else ""
        got = "null" if value is None else f"{type(value).__name__} {value!r}"
        if dataclasses.is_dataclass(tp):
            return self.build(tp, value, key)
        if origin is Literal:
            for allowed in args:
                if type(value) is type(allowed) and value == allowed:
                    return value
            shown = ", ".join(str(a) for a in args) + (", null" if nullable else "")
            raise self.fail(key, f"got {'null' if value is None else repr(value)}; allowed values: {shown}")
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            if len(inner) != 1 or len(args) != 2:
                raise TypeError(f"schema union {tp} not supported")  # a bug in this file, not the config
            return None if value is None else self.convert(inner[0], value, key, nullable=True)
        if origin is tuple:
            if not isinstance(value, (list, tuple)):
                raise self.fail(key, f"expected {_type_name(tp)}{orr}, got {got}")
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.fail(key, f"expected {_type_name(tp)}, got {len(value)} item(s) {list(value)!r}")
            return tuple(self.convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        if tp is bool:
            if isinstance(value, bool):
                return value
        elif tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    return float(value)
                raise self.fail(key, f"must be finite, got {value!r}")
        elif tp is str:
            if isinstance(value, str) and value:
                return value
            if isinstance(value, str):
                raise self.fail(key, "must not be empty" + (" (use null for none)" if nullable else ""))
        else:
            raise TypeError(f"schema type {tp} not supported")  # a bug in this file, not the config
        raise self.fail(key, f"expected {_type_name(tp)}{orr}, got {got}")


# --- combinations ---------------------------------------------------------------------------

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
    if cfg.kernels.require_liger and cfg.kernels.policy == "pytorch":
        raise b.fail("kernels.require_liger", "kernels.policy pytorch never selects Liger; use policy auto "
                                              "or triton, or require_liger false", "kernels.policy")
    if cfg.kernels.compile != "none" and cfg.parallel.ep_size > 1:
        raise b.fail("kernels.compile", "compiling the expert-parallel layers (their all-to-all token exchange) "
                                        "is not supported; use kernels.compile none with parallel.ep_size > 1",
                     "parallel.ep_size")
    if cfg.model.preset != "tiny":
        # null paths mean "the embedded demo corpus", which is sized for the tiny preset only.
        need = ("data.plan", cfg.data.plan) if cfg.data.kind == "pretrain" else ("data.sft_dir", cfg.data.sft_dir)
        if need[1] is None:
            raise b.fail(need[0], f"required for preset {cfg.model.preset}; null (the embedded demo corpus) "
                                  "is allowed only with preset tiny", "model.preset")
        if cfg.data.kind == "pretrain" and cfg.data.shards_dir is None:
            raise b.fail("data.shards_dir", f"required for preset {cfg.model.preset} with data.kind pretrain", "model.preset")
    num_experts, max_seq = _model_facts(cfg.model.preset)
    if num_experts % cfg.parallel.ep_size:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise b.fail("parallel.ep_size", f"must divide the {num_experts} routed experts of preset "
                                         f"{cfg.model.preset}; allowed: {', '.join(map(str, divisors))}", "model.preset")
    if max_seq is not None and cfg.data.seq_len > max_seq:
        raise b.fail("data.seq_len", f"{cfg.data.seq_len} exceeds the {max_seq}-token context of preset "
                                     f"{cfg.model.preset}; allowed: 1..{max_seq}", "model.preset")


# --- public API ------------------------------------------------------------------------------

def _set_path(raw: dict, dotted: str, value: Any, label: str) -> None:
    """Place an override into the raw mapping, refusing keys the schema does not have."""
    cls: Any = TrainConfig
    node = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = _schema_fields(cls)
        if part not in fields:
            done = ".".join(parts[:i]) or "<top level>"
            raise ConfigError(label, dotted, f"unknown key; allowed keys under {done}: {', '.join(sorted(fields))}")
        tp = _hints(cls)[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp) and isinstance(value, Mapping) and isinstance(node.get(part), Mapping):
                node[part] = {**node[part], **value}
            else:
                node[part] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(label, dotted, f"{'.'.join(parts[: i + 1])} is not a section")
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None or not isinstance(child, Mapping) else dict(child)
            node[part] = child
        node = child
        cls = tp


def config_from_dict(raw: Any, source: str = "<dict>", overrides: Sequence[str] = ()) -> TrainConfig:
    """Validate a mapping (a parsed YAML document) plus ``a.b=v`` overrides."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(source, "", f"the document must be a mapping of sections, got {type(raw).__name__}")
    raw = _deep_copy(raw)
    key_sources: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item}", "", "expected KEY=VALUE, e.g. --set optimizer.lr=3.0e-4")
        dotted, text = item.split("=", 1)
        dotted = dotted.strip()
        label = f"--set {dotted}"
        try:
            value = _yaml_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(label, dotted, f"value {text!r} is not valid YAML: {err}") from None
        _set_path(raw, dotted, value, label)
        key_sources[dotted] = label
    b = _Builder(source, key_sources)
    cfg = b.build(TrainConfig, raw, "")
    origin = source if not overrides else f"{source} with {', '.join('--set ' + o for o in overrides)}"
    cfg = dataclasses.replace(cfg, origin=origin)
    _check_combinations(cfg, b)
    return cfg


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, Mapping):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML training config and apply ``--set`` overrides; raises ConfigError."""
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(path, "", f"cannot read config file: {err.strerror or err}") from None
    try:
        raw = _yaml_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(path, "", f"not valid YAML: {err}") from None
    return config_from_dict(raw, source=path, overrides=overrides)


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


def tokens_per_step(cfg: TrainConfig, world_size: int) -> int:
    """Token positions per optimizer step (for SFT, the packed capacity, not supervised tokens)."""
    _check_world(cfg, world_size)
    return cfg.data.seq_len * cfg.batch.micro_batch * cfg.batch.grad_accum * world_size


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
    _check_world(cfg, world_size)
    mb, ga = cfg.batch.micro_batch, cfg.batch.grad_accum
    fp16: dict[str, Any] = {"enabled": cfg.precision == "fp16"}
    if cfg.precision == "fp16":
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": ga,
        "train_batch_size": mb * ga * world_size,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": fp16,
        "zero_optimization": {"stage": cfg.zero.stage},
        # Our Progress display reports; DeepSpeed's own prints would interleave with it.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def training_critical(cfg: TrainConfig) -> dict:
    """Settings an exact resume must match (docs/contracts.md §4), as a flat ``{dotted key: value}`` dict.

    Left out on purpose: where things are written or cached (output_dir, cache, checkpoint
    cadence, logging, evaluation) -- they do not change the trained trajectory. LoRA details
    are included only when LoRA is on, so editing an unused default does not block a resume.
    """
    d, o, s = cfg.data, cfg.optimizer, cfg.schedule
    crit: dict[str, Any] = {
        "stage": cfg.stage,
        "source_stage": cfg.source_stage,
        "model.preset": cfg.model.preset,
        "model.family": cfg.model.family,
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
        "schedule.warmup_fraction": s.warmup_fraction,
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
    if cfg.lora.enabled:
        crit.update({f"lora.{k}": v for k, v in _plain(cfg.lora).items() if k != "enabled"})
    return crit
