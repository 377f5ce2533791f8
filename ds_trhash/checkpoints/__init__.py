"""Checkpoints: the crash-safe store, the resume rules, resharding, and the one weights loader.

Modules, by job:

* ``state``   - file names, errors, ``TrainerState`` and ``LaunchRecord`` (what ``trainer_state.json``
  records), the hardware it names;
* ``store``   - atomic publish, manifest, verify, list, rotation;
* ``resume``  - choosing the checkpoint to continue from and what must match (the refusals);
* ``reshard`` - universal conversion for a new world size, and restoring a DeepSpeed engine;
* ``weights`` - weights-only load, LoRA merge, expert-parallel consolidation: the loader that
  ``--init-checkpoint``, eval and export all use;
* ``rng``     - every generator of a rank, saved and restored as one unit;
* ``stages``  - the stage guard: which checkpoint may start which stage;
* ``sync_guard`` - the lock rotation and Hub sync share, and the record of what a sync verified.

The names below are the package's public surface; ``from ds_trhash import checkpoints as ckpt``
then ``ckpt.save_checkpoint(...)``. This package imports ``ds_trhash.io`` and (lazily, for
merging and consolidation) ``ds_trhash.model``; never training, eval or release.
"""
from ds_trhash.checkpoints.reshard import (
    RESHARD_DIR,
    UNIVERSAL_FORMAT,
    UNIVERSAL_RECORD,
    convert_to_universal,
    load_engine_state,
    needs_universal,
    reseed_rng_for_reshard,
    reshard_report,
    reshard_rng_seed,
    universal_dir_for,
)
from ds_trhash.checkpoints.resume import (
    REQUIRED_STATE_PARTS,
    RESHARD_LAYOUT_KEYS,
    check_output_dir_stage,
    check_resume_compatible,
    find_resumable,
    global_batch,
    inspect_saved_parts,
    is_reshard,
    resolve_resume,
)
from ds_trhash.checkpoints.state import (
    CHECKPOINTS,
    ENGINE_TAG,
    MANIFEST,
    MANIFEST_FORMAT,
    TRAINER_STATE,
    CheckpointError,
    LaunchRecord,
    ResumeError,
    TrainerState,
    describe_hardware,
    read_trainer_state,
)
from ds_trhash.checkpoints.store import (
    CheckpointInfo,
    checkpoints_root,
    list_checkpoints,
    rotate,
    rotate_unless_syncing,
    rotation_survivors,
    save_checkpoint,
    step_dir_name,
    verify,
)
from ds_trhash.checkpoints.weights import (
    load_merged_weights,
    load_weights_only,
    read_source_metadata,
    read_source_record,
)

__all__ = [
    "CHECKPOINTS", "ENGINE_TAG", "MANIFEST", "MANIFEST_FORMAT", "REQUIRED_STATE_PARTS", "RESHARD_DIR",
    "RESHARD_LAYOUT_KEYS", "TRAINER_STATE", "UNIVERSAL_FORMAT", "UNIVERSAL_RECORD", "CheckpointError",
    "CheckpointInfo", "LaunchRecord", "ResumeError", "TrainerState", "check_output_dir_stage", "check_resume_compatible",
    "checkpoints_root", "convert_to_universal", "describe_hardware", "find_resumable", "global_batch", "inspect_saved_parts",
    "is_reshard", "list_checkpoints", "load_engine_state", "load_merged_weights", "load_weights_only",
    "needs_universal", "read_source_metadata", "read_source_record", "read_trainer_state", "reseed_rng_for_reshard",
    "reshard_report", "reshard_rng_seed", "resolve_resume", "rotate", "rotate_unless_syncing", "rotation_survivors",
    "save_checkpoint", "step_dir_name", "universal_dir_for", "verify",
]
