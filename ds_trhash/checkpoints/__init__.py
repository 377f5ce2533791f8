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

The names below are the package's public surface, imported from the modules that need no torch
(``state``, ``store``, ``consistency``, ``resume``, ``reshard``: ``from ds_trhash import checkpoints as
ckpt`` then ``ckpt.list_checkpoints(...)``), so a command that only lists, verifies or prunes
checkpoints starts without importing torch. What needs torch is imported from its module by name:
``from ds_trhash.checkpoints.save import save_checkpoint``, ``...weights import load_merged_weights``,
``...hardware import describe_hardware``. This package imports ``ds_trhash.io`` and (for merging
and consolidation) ``ds_trhash.model``; never training, eval or release.
"""
from .consistency import engine_states, inconsistency, trusted
from .reshard import (RESHARD_DIR, UNIVERSAL_FORMAT, UNIVERSAL_RECORD, convert_to_universal, load_engine_state,
                      needs_universal, reseed_rng_for_reshard, reshard_report, reshard_rng_seed, universal_dir_for)
from .resume import (REQUIRED_STATE_PARTS, RESHARD_LAYOUT_KEYS, check_output_dir_stage, check_resume_compatible,
                     find_resumable, global_batch, inspect_saved_parts, is_reshard, resolve_resume)
from .state import (CHECKPOINTS, ENGINE_TAG, MANIFEST, MANIFEST_FORMAT, TRAINER_STATE, CheckpointError, LaunchRecord,
                    ResumeError, TrainerState, capped_by, read_trainer_state)
from .store import (CheckpointInfo, checkpoints_root, list_checkpoints, rotate, rotate_unless_syncing,
                    rotation_survivors, step_dir_name, verify)

__all__ = ["CHECKPOINTS", "ENGINE_TAG", "MANIFEST", "MANIFEST_FORMAT", "REQUIRED_STATE_PARTS", "RESHARD_DIR",
           "RESHARD_LAYOUT_KEYS", "TRAINER_STATE", "UNIVERSAL_FORMAT", "UNIVERSAL_RECORD", "CheckpointError",
           "CheckpointInfo", "LaunchRecord", "ResumeError", "TrainerState", "capped_by", "check_output_dir_stage",
           "check_resume_compatible", "checkpoints_root", "convert_to_universal", "engine_states", "find_resumable",
           "global_batch", "inconsistency", "inspect_saved_parts", "is_reshard", "list_checkpoints",
           "load_engine_state", "needs_universal", "read_trainer_state", "reseed_rng_for_reshard", "reshard_report",
           "reshard_rng_seed", "resolve_resume", "rotate", "rotate_unless_syncing", "rotation_survivors",
           "step_dir_name", "trusted", "universal_dir_for", "verify"]
