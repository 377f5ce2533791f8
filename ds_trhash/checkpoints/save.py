"""Writing a checkpoint so that it is visible only when complete.

Everything is written into ``step_<N>.tmp`` and renamed by rank 0 only after every rank has
finished and the manifest (written last) has been fsynced; ``store`` lists, verifies and
rotates what this publishes.

The trainer writes the same checkpoint in the background (``background.BackgroundSaver``), which
shares ``_prepare`` and ``_finalize`` with this synchronous save.

The DeepSpeed engine is never imported here: its ``save_checkpoint`` is passed in as a
callable, so the crash-safety rules are tested with a fake writer, and the trainer calls::

    save_checkpoint(output_dir, step,
                    write_engine_state=lambda tmpdir: engine.save_checkpoint(tmpdir, tag=ENGINE_TAG),
                    trainer_state=state, rank=rank, world_size=world_size, barrier=dist.barrier)
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.rng import save_rng_state
from ds_trhash.checkpoints.state import MANIFEST, MANIFEST_FORMAT, TRAINER_STATE, CheckpointError, TrainerState, rng_path
from ds_trhash.checkpoints.store import _synced_entries, checkpoints_root, step_dir_name
from ds_trhash.io import fsync_tree, publish_dir, write_json


def _state_doc(trainer_state: TrainerState | Mapping[str, Any]) -> dict[str, Any]:
    """The trainer_state.json document: the typed fields, validated, plus any extra keys the
    trainer records (tokens seen, the plan document, the model config, ...)."""
    if isinstance(trainer_state, TrainerState):
        return trainer_state.to_dict()
    return {**dict(trainer_state), **TrainerState.from_dict(trainer_state).to_dict()}


def never_refuse() -> str | None:
    return None


def _finalize(tmp: Path, final: Path, doc: dict[str, Any], world_size: int,
              known: Mapping[str, dict[str, Any]] | None = None,
              may_publish: Callable[[], str | None] = never_refuse) -> None:
    """Rank 0, after every rank wrote its files: state, fsync, manifest last, atomic rename.
    ``known``: size and SHA-256 of files already hashed (and fsynced) as they were written.
    ``may_publish``: asked right before the rename; a reason refuses it (the launch's liveness: a
    rank was lost, or this one was frozen, so the others may have given up on this checkpoint)."""
    absent = [r for r in range(world_size) if not rng_path(tmp, r).is_file()]
    if absent:
        raise CheckpointError(f"ranks {absent} wrote no RNG state into {tmp}; the checkpoint is incomplete "
                              "and was not published")
    doc = {**doc, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(tmp / TRAINER_STATE, doc)
    write_json(tmp / MANIFEST, {"format": MANIFEST_FORMAT, "step": doc["step"], "files": _synced_entries(tmp, known)})
    fsync_tree(tmp)
    refusal = may_publish()
    if refusal is not None:
        raise CheckpointError(f"{tmp.name} was not published: {refusal}; the last complete checkpoint stays the newest")
    publish_dir(tmp, final)  # a re-save of the same step swaps the old copy out atomically


def _prepare(output_dir: str | os.PathLike, step: int, doc: dict[str, Any], rank: int, world_size: int,
             barrier: Callable[[], Any]) -> tuple[Path, Path]:
    """Every rank: check the record against the save, then (rank 0) an empty ``step_<N>.tmp``
    that every rank writes into. Returns (final, tmp)."""
    if doc["step"] != step or doc["world_size"] != world_size:
        raise CheckpointError(
            f"trainer_state says step {doc['step']}, world size {doc['world_size']} but the save is "
            f"for step {step}, world size {world_size}; build the state from the same counters"
        )
    root = checkpoints_root(output_dir)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    refused: OSError | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
            tmp.mkdir()
        except OSError as exc:  # a full or read-only disk: every rank fails here, not at the barrier
            refused = exc
    barrier()
    if refused is not None:
        raise refused
    tmp.mkdir(parents=True, exist_ok=True)  # exists (rank 0 made it); else this rank's own OSError
    return final, tmp


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    write_engine_state: Callable[[Path], Any],
    trainer_state: TrainerState | Mapping[str, Any],
    rank: int,
    world_size: int,
    barrier: Callable[[], Any] = lambda: None,
    rng_state: dict[str, Any] | None = None,
    may_publish: Callable[[], str | None] = never_refuse,
) -> Path:
    """Write checkpoint ``step`` on every rank; it becomes visible only when complete.

    All ranks must call this collectively (DeepSpeed's save is itself collective). The
    temporary directory name is the same on every rank so that all of them write into it.
    ``trainer_state`` may be a plain dict: it must hold every ``TrainerState`` field without a
    default, and extra keys are kept. ``may_publish``: the publish guard (``_finalize``).
    """
    doc = _state_doc(trainer_state)
    final, tmp = _prepare(output_dir, step, doc, rank, world_size, barrier)
    write_engine_state(tmp)
    save_rng_state(tmp, rank, rng_state)
    barrier()
    if rank == 0:
        _finalize(tmp, final, doc, world_size, may_publish=may_publish)
    barrier()
    return final
