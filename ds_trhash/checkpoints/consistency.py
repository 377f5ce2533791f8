"""Whether a checkpoint's own records agree with each other, before it is chosen to continue from.

``store.verify`` proves that every file is the one its manifest lists; it cannot tell a manifest
resealed over edited files. A ``step_00000004`` whose ``trainer_state.json`` says step 2 would be
resumed "at step 2": steps 3 and 4 trained again, the genuine ``step_00000003`` written over. So
the folder name, the trainer state's step and its counters (data cursor, tokens seen), and the
engine's own step, sample count and schedule position (DeepSpeed's model-states file) must tell
one story. A checkpoint whose records disagree is treated like a damaged one: ``--resume auto``
sets it aside and falls back, an explicit ``--resume DIR`` and ``--init-checkpoint RUN`` refuse
it or pass over it (docs/stages.md, "Auto-resume").
"""
from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_trhash.batch_layout import step_rows
from ds_trhash.checkpoints.state import _STEP_DIR, ENGINE_TAG, CheckpointError, read_trainer_state
from ds_trhash.checkpoints.store import verify


def engine_states(ckpt_dir: str | os.PathLike) -> dict[str, Any] | None:
    """DeepSpeed's model-states record of a checkpoint (rank 0's; memory-mapped, so the weights in
    it are not read), or None when the checkpoint has none."""
    import torch  # only here: listing and verifying checkpoints never needs torch

    tag_dir = Path(ckpt_dir) / ENGINE_TAG
    # expert-parallel runs add per-expert layer_*_expert_* files beside the engine's own
    files = sorted(p for p in tag_dir.glob("*model_states.pt") if not p.name.startswith("layer_"))
    if not files:
        return None
    return torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)


def _int(doc: Mapping[str, Any], key: str) -> int | None:
    value = doc.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rows_per_step(state: Mapping[str, Any]) -> int | None:
    """Rows one optimizer step reads over all ranks, from the checkpoint's own settings."""
    critical = state.get("training_critical") or {}
    mb, ga, world = _int(critical, "batch.micro_batch"), _int(critical, "batch.grad_accum"), _int(state, "world_size")
    return step_rows(mb, ga, world) if mb is not None and ga is not None and world is not None else None


def _state_problems(name_step: int | None, state: Mapping[str, Any]) -> list[str]:
    """What ``trainer_state.json`` says that contradicts the folder name or itself."""
    problems: list[str] = []
    step = _int(state, "step")
    if step is None:
        return [f"trainer_state.json records no integer step ({state.get('step')!r})"]
    if name_step is not None and name_step != step:
        problems.append(f"its folder is step {name_step}, trainer_state.json says step {step}")
    total = _int(state, "total_steps")
    if total is not None and step > total:
        problems.append(f"trainer_state.json says step {step} of {total}")
    critical = state.get("training_critical") or {}
    rows, cursor = _rows_per_step(state), _int(state, "data_cursor")
    sft = critical.get("data.kind") == "sft"
    per_step = _int(critical, "batch.grad_accum") if sft else rows
    if cursor is not None and per_step is not None and cursor != step * per_step:
        problems.append(f"data_cursor is {cursor}, but {step} steps of {per_step} {'micro-steps' if sft else 'rows'} "
                        f"end at {step * per_step}")
    tokens, seq_len = _int(state, "tokens_seen"), _int(critical, "data.seq_len")
    if not sft and tokens is not None and cursor is not None and seq_len is not None and tokens != cursor * seq_len:
        problems.append(f"tokens_seen is {tokens}, but {cursor} rows of {seq_len} tokens are {cursor * seq_len}")
    supervised = _int(state, "supervised_seen")
    if tokens is not None and supervised is not None and supervised > tokens:
        problems.append(f"supervised_seen {supervised} exceeds tokens_seen {tokens}")
    return problems


def _engine_problems(step: int, rows: int | None, engine: Mapping[str, Any]) -> list[str]:
    """What the engine's own record says against the trainer state's step."""
    problems: list[str] = []
    global_steps, skipped = _int(engine, "global_steps"), _int(engine, "skipped_steps") or 0
    if global_steps is not None and global_steps != step:
        problems.append(f"the engine state is at step {global_steps}, trainer_state.json at step {step}")
    samples = _int(engine, "global_samples")
    if samples is not None and rows is not None and samples != step * rows:
        problems.append(f"the engine counted {samples} samples, {step} steps of {rows} rows are {step * rows}")
    scheduler = engine.get("lr_scheduler")
    position = _int(scheduler, "last_epoch") if isinstance(scheduler, Mapping) else None
    # DeepSpeed does not step the schedule on a step it skipped (an fp16 overflow)
    if position is not None and position != step - skipped:
        problems.append(f"the learning-rate schedule is at step {position}, trainer_state.json at step {step}"
                        + (f" ({skipped} skipped)" if skipped else ""))
    return problems


def inconsistency(ckpt_dir: str | os.PathLike) -> str | None:
    """Why a (verified) checkpoint's records disagree, as a reason that reads after "<name> is",
    or None when they agree."""
    path = Path(ckpt_dir)
    match = _STEP_DIR.match(path.name)
    try:
        state = read_trainer_state(path)
    except CheckpointError as exc:
        return f"corrupt ({exc})"
    problems = _state_problems(int(match.group(1)) if match else None, state)
    if not problems:
        try:
            engine = engine_states(path)
        except (pickle.UnpicklingError, EOFError, RuntimeError):
            engine = None  # not a torch file: nothing to cross-check here; restoring the engine refuses it
        if isinstance(engine, Mapping):  # anything else is no engine record; loading it refuses it
            problems = _engine_problems(int(state["step"]), _rows_per_step(state), engine)
    return f"inconsistent ({'; '.join(problems)})" if problems else None


def trusted(ckpt_dir: str | os.PathLike) -> tuple[bool, str]:
    """(ok, reason): the checkpoint verifies against its manifest and its records agree. The
    test every choice of a checkpoint to continue or start from makes."""
    ok, reason = verify(ckpt_dir)
    if not ok:
        return ok, reason
    why = inconsistency(ckpt_dir)
    return (False, why) if why else (True, "ok")
