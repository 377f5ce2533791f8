"""Training configuration: YAML -> typed, validated dataclasses.

A launch on many GPUs should fail in the first second, on every rank alike, with a message
that names the file (or ``--set`` override), the dotted key and what would have been
accepted -- not an hour later inside DeepSpeed. So the whole schema is checked when the file
is loaded: unknown keys, types, enum values, ranges and combinations that cannot run. The
one exception is ``source_stage``, which the CLI may still supply after loading; see
:func:`require_source_stage`.

The package is split by job; its public names are re-exported here (``tcfg.X``):
- ``schema``: the section dataclasses (field names are the YAML keys), their value checks,
  ``TrainConfig``, ``ConfigError``, ``dump_config``;
- ``reading``: YAML loading (duplicate keys refused), ``--set`` overrides and the typed builder
  (``load_config``, ``config_from_dict``);
- ``checks``: combinations that cannot run, the device check, the declared source stage;
- ``layout``: what depends on the world size (``batch_layout``, ``for_world``,
  ``tokens_per_step``, ``to_deepspeed_dict``, ``training_critical``).

Key reference: ``docs/configs.md``.
"""
from __future__ import annotations

from ds_trhash.model.lora import DEFAULT_LORA_TARGETS, LORA_TARGETS

from .checks import check_device, check_paths, require_source_stage
from .layout import (
    as_number,
    batch_layout,
    for_world,
    grad_accum,
    micro_batch,
    model_config,
    to_deepspeed_dict,
    tokens_per_step,
    training_critical,
    with_micro_batch,
)
from .reading import (
    REMOVED_KEYS,
    DuplicateKeyError,
    config_from_dict,
    load_config,
)
from .schema import (
    SFT,
    STAGES,
    BatchSection,
    CheckpointSection,
    ConfigError,
    DataSection,
    EvalSection,
    KernelsSection,
    LoraSection,
    ModelSection,
    OptimizerSection,
    PackingSection,
    ParallelSection,
    ScheduleSection,
    TrainConfig,
    TrainingSection,
    ZeroSection,
    dump_config,
)

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
    "SFT",
    "REMOVED_KEYS",
    "DuplicateKeyError",
    "LORA_TARGETS",
    "load_config",
    "config_from_dict",
    "dump_config",
    "require_source_stage",
    "check_device",
    "check_paths",
    "to_deepspeed_dict",
    "training_critical",
    "tokens_per_step",
    "batch_layout",
    "for_world",
    "as_number",
    "with_micro_batch",
    "grad_accum",
    "micro_batch",
    "model_config",
]
