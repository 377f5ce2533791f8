"""Checkpoints: the crash-safe store, the resume rules, resharding, and the one weights loader.

Modules, by job:

* ``state``   - file names, errors, ``TrainerState`` and ``LaunchRecord`` (what ``trainer_state.json``
  records);
* ``hardware`` - the accelerator or CPU a checkpoint and a run record name (asks torch);
* ``store``   - manifest, verify, list, rotation;
* ``consistency`` - whether a checkpoint's own records agree (folder name, step, counters, the
  engine's step and schedule): the test before one is chosen to resume or start from;
* ``save``    - writing a checkpoint that is visible only when complete (atomic publish);
* ``background`` - the same checkpoint written by a thread after the step captured the state
  (``snapshot``: a host copy of a state that training goes on updating in place);
* ``resume``  - choosing the checkpoint to continue from and what must match (the refusals);
* ``reshard`` - universal conversion for a new world size, and restoring a DeepSpeed engine;
* ``weights`` - weights-only load, LoRA merge, expert-parallel consolidation: the loader that
  ``--init-checkpoint``, eval and export all use;
* ``rng``     - every generator of a rank, saved and restored as one unit;
* ``stages``  - the stage guard: which checkpoint may start which stage;
* ``sync_guard`` - the lock rotation and Hub sync share, and the record of what a sync verified.

The names below are the package's public surface; ``from ds_trhash import checkpoints as ckpt``
then ``ckpt.save_checkpoint(...)``. Each is loaded from its module when first used (PEP 562), so
a command that only lists, verifies or prunes checkpoints (``state``, ``store``, ``sync_guard``,
``run_lock``: no torch) starts without importing torch. This package imports ``ds_trhash.io``
and (lazily, for merging and consolidation) ``ds_trhash.model``; never training, eval or release.
"""
import importlib
from typing import Any

# public name -> the module of this package that defines it
_MODULES = {
    "state": ("CHECKPOINTS", "ENGINE_TAG", "MANIFEST", "MANIFEST_FORMAT", "TRAINER_STATE", "CheckpointError",
              "LaunchRecord", "ResumeError", "TrainerState", "capped_by", "read_trainer_state"),
    "hardware": ("describe_hardware",),
    "store": ("CheckpointInfo", "checkpoints_root", "list_checkpoints", "rotate", "rotate_unless_syncing",
              "rotation_survivors", "step_dir_name", "verify"),
    "consistency": ("engine_states", "inconsistency", "trusted"),
    "save": ("save_checkpoint",),
    "resume": ("REQUIRED_STATE_PARTS", "RESHARD_LAYOUT_KEYS", "check_output_dir_stage", "check_resume_compatible",
               "find_resumable", "global_batch", "inspect_saved_parts", "is_reshard", "resolve_resume"),
    "reshard": ("RESHARD_DIR", "UNIVERSAL_FORMAT", "UNIVERSAL_RECORD", "convert_to_universal", "load_engine_state",
                "needs_universal", "reseed_rng_for_reshard", "reshard_report", "reshard_rng_seed",
                "universal_dir_for"),
    "weights": ("load_merged_weights", "load_weights_only", "read_source_metadata", "read_source_record"),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = sorted(_WHERE)
