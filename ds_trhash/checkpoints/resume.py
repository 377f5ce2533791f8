"""Resuming: which checkpoint to continue from, what must match, and restoring the engine.

A resume is an exact continuation of the saved run or it is refused, with every difference
named at once (docs/contracts.md, "Checkpoints and resume"). Everything here except
``load_engine_state`` runs before a model exists, so a wrong resume costs seconds.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_trhash.batch_layout import step_rows
from ds_trhash.checkpoints.consistency import engine_states, trusted
from ds_trhash.checkpoints.state import rng_path
from ds_trhash.checkpoints.state import (
    ENGINE_TAG,
    TRAINER_STATE,
    Log,
    ResumeError,
    TrainerState,
    read_trainer_state,
)
from ds_trhash.checkpoints.store import CheckpointInfo, checkpoints_root, list_checkpoints

def find_resumable(output_dir: str | os.PathLike, log: Log = print) -> CheckpointInfo | None:
    """The newest checkpoint that fully verifies and whose records agree (``consistency``); newer
    broken ones are reported and skipped."""
    skipped: list[tuple[CheckpointInfo, str]] = []
    for info in reversed(list_checkpoints(output_dir)):
        ok, reason = trusted(info.path)
        if ok:
            for bad, why in skipped:
                log(f"{bad.name} is {why} — falling back to {info.name}")
            return info
        skipped.append((info, reason))
    for bad, why in skipped:
        log(f"{bad.name} is {why} — no complete checkpoint left to fall back to")
    return None


def resolve_resume(
    arg: str | None,
    env_value: str | None,
    output_dir: str | os.PathLike,
    log: Log = print,
) -> CheckpointInfo | None:
    """Turn ``--resume`` / ``RESUME`` into the checkpoint to continue from, or None for a fresh start.

    "auto" takes the newest complete checkpoint under ``output_dir`` (none: fresh start, said
    in a message). An explicit directory must verify; a broken one is an error, never a
    silent fresh start.
    """
    arg = arg or None
    env_value = env_value or None
    if arg and env_value and arg != env_value:
        raise ResumeError(f"--resume {arg!r} and RESUME={env_value!r} disagree; unset one of them")
    choice = arg or env_value
    if choice is None:
        return None
    if choice == "auto":
        info = find_resumable(output_dir, log)
        if info is None:
            log(f"resume auto: no complete checkpoint under {checkpoints_root(output_dir)} — starting fresh")
        else:
            log(f"resume auto: continuing from {info.path}")
        return info
    path = Path(choice)
    ok, reason = trusted(path)
    if not ok:
        raise ResumeError(f"cannot resume from {path}: it is {reason}; pass another checkpoint or --resume auto")
    return CheckpointInfo(int(read_trainer_state(path)["step"]), path, True)

# --------------------------------------------------------------------------- resume compatibility


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = list(value) if isinstance(value, tuple) else value
    return flat


_ABSENT = "<absent>"
REQUIRED_STATE_PARTS = ("model", "optimizer", "scheduler", "rng")
# The per-rank layout: free under --reshard as long as the global batch is unchanged (experts move
# by global id between expert-parallel layouts, checkpoints/expert_reshard.py).
RESHARD_LAYOUT_KEYS = ("batch.micro_batch", "batch.grad_accum", "parallel.ep_size")


def global_batch(flat_critical: Mapping[str, Any], world_size: int) -> tuple[int, int, int, int] | None:
    """(rows per optimizer step, micro_batch, grad_accum, world_size), or None when the settings
    do not say (a checkpoint of another trainer version)."""
    mb, ga = flat_critical.get("batch.micro_batch"), flat_critical.get("batch.grad_accum")
    if not isinstance(mb, int) or not isinstance(ga, int):
        return None
    return step_rows(mb, ga, world_size), mb, ga, world_size


def _describe_global_batch(g: tuple[int, int, int, int] | None, world_size: int) -> str:
    if g is None:
        return f"unknown (no batch.micro_batch / batch.grad_accum recorded, {world_size} ranks)"
    return f"{g[0]} rows per step (micro_batch {g[1]} × grad_accum {g[2]} × {g[3]} rank{'s' if g[3] != 1 else ''})"


def _run_identity_problems(state: TrainerState, *, stage: str | None, world_size: int, lora_enabled: bool,
                           reshard: bool) -> list[str]:
    """Stage, world size and LoRA: what the run is, before any setting; each difference says the
    way out (a new stage, the saved rank count, ``--reshard``), since none is a setting to edit."""
    problems: list[str] = []
    if stage is not None and state.stage != stage:
        problems.append(f"stage: checkpoint {state.stage!r}, this run {stage!r} — a run never loads another "
                        "stage into the same output directory; use a new output_dir with --init-checkpoint")
    if state.world_size != world_size and not reshard:
        problems.append(f"world_size: checkpoint {state.world_size}, this run {world_size} — relaunch with "
                        f"{state.world_size} ranks, or convert the checkpoint with --reshard first")
    if bool(state.lora) != bool(lora_enabled):
        kinds = {True: "LoRA", False: "full-parameter"}
        problems.append(f"lora: checkpoint is {kinds[bool(state.lora)]}, this run is {kinds[bool(lora_enabled)]} "
                        "— a full-parameter run never resumes LoRA state (or the reverse); start a new stage "
                        "with --init-checkpoint")
    return problems


def _global_batch_problems(old: Mapping[str, Any], new: Mapping[str, Any], saved_world: int,
                           world_size: int) -> list[str]:
    """A ``--reshard`` may change the batch layout but not the rows per step: the data order, the
    step count and the schedule depend on them."""
    before_g, after_g = global_batch(old, saved_world), global_batch(new, world_size)
    # Settings without any batch layout (neither side records one) leave nothing to compare;
    # one side without it cannot prove the global batch unchanged and is refused.
    if (before_g, after_g) != (None, None) and (before_g is None or after_g is None or before_g[0] != after_g[0]):
        return [
            f"global batch: checkpoint {_describe_global_batch(before_g, saved_world)}, this run "
            f"{_describe_global_batch(after_g, world_size)} — --reshard keeps the global batch (the data "
            "order, the step count and the schedule depend on it); choose batch.micro_batch and "
            f"batch.grad_accum with micro_batch·grad_accum·{world_size} = "
            f"{before_g[0] if before_g else '?'}"]
    return []


def _setting_differences(old: Mapping[str, Any], new: Mapping[str, Any], skip: tuple[str, ...]) -> list[str]:
    """Every training-critical key whose value differs (or is on one side only), in key order,
    so the operator sees all of them at once; ``skip`` holds the keys compared another way."""
    problems: list[str] = []
    for key in sorted(set(old) | set(new)):
        if key in skip:
            continue
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before != after:
            problems.append(f"{key}: checkpoint {before!r}, this run {after!r}")
    return problems


def _plan_and_step_problems(state: TrainerState, plan_sha256: str | None, total_steps: int,
                            finished_ok: bool) -> list[str]:
    """A plan file edited in place, and a checkpoint that leaves nothing to train (at the last step
    only when ``finished_ok``, see ``check_resume_compatible``)."""
    problems: list[str] = []
    if plan_sha256 is not None and state.plan_sha256 != plan_sha256:
        problems.append(f"plan_sha256: checkpoint {state.plan_sha256!r}, this run {plan_sha256!r} — the replay "
                        "plan file changed; a changed plan is a new stage")
    if state.step > total_steps or (state.step == total_steps and not finished_ok):
        problems.append(f"step: checkpoint is at step {state.step}, at or past the end of this run "
                        f"({total_steps} steps) — nothing is left to train")
    return problems


def _missing_part_problems(found: Mapping[str, bool] | None) -> list[str]:
    """The state parts the checkpoint lacks (when ``found`` was given): a resume never restarts one."""
    problems: list[str] = []
    for part in REQUIRED_STATE_PARTS:
        if found is not None and not found.get(part, False):
            problems.append(f"{part}: no {part} state was found in the checkpoint — a resume never restarts it")
    return problems


def check_resume_compatible(
    saved_state: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    world_size: int,
    lora_enabled: bool,
    total_steps: int,
    stage: str | None = None,
    plan_sha256: str | None = None,
    reshard: bool = False,
    found: Mapping[str, bool] | None = None,
    finished_ok: bool = False,
) -> None:
    """Refuse any resume that is not exact continuation, naming every difference at once.

    ``current`` is this launch's training-critical settings (``config.training_critical``).
    ``plan_sha256``: this launch's plan file hash (a plan edited in place under the same path).
    ``reshard``: the operator asked for a world-size change (``--reshard``); the RNG of new ranks
    cannot be exact, so only then is a different world size accepted, and then
    ``batch.micro_batch`` / ``batch.grad_accum`` may change too, provided the global batch
    (micro_batch · grad_accum · world_size rows per step) is the checkpoint's: the data order
    and the step count depend on it, so the same rows continue. Everything else must match.
    ``found``: which of optimizer / scheduler / rng state the checkpoint holds
    (``inspect_saved_parts``), checked when given.
    ``finished_ok``: a checkpoint at the last step is accepted (``--resume auto`` of a finished
    run: nothing is trained, the launch completes what the stage's end left unrecorded and
    exits 0, so a supervised chain restarted after a reboot goes on); an explicit ``--resume DIR``
    of the last step is refused, and past the last step always is.
    """
    state = TrainerState.from_dict(saved_state)
    problems = _run_identity_problems(state, stage=stage, world_size=world_size, lora_enabled=lora_enabled,
                                      reshard=reshard)
    old, new = _flatten(state.training_critical), _flatten(current)
    layout_keys: tuple[str, ...] = ()
    if reshard:
        layout_keys = RESHARD_LAYOUT_KEYS
        problems += _global_batch_problems(old, new, state.world_size, world_size)
    problems += _setting_differences(old, new, skip=layout_keys)
    problems += _plan_and_step_problems(state, plan_sha256, total_steps, finished_ok)
    problems += _missing_part_problems(found)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ResumeError(
            f"cannot resume: {len(problems)} difference(s) from the checkpoint at step {state.step}:\n{listing}\n"
            "A resume is exact continuation. Changed settings make a new stage: use a new output_dir and "
            "--init-checkpoint (weights only)."
        )


def check_output_dir_stage(output_dir: str | os.PathLike, stage: str) -> None:
    """Refuse to write one stage's checkpoints beside another's (docs/contracts.md §4): a later RESUME=auto
    would otherwise pick up the wrong stage."""
    for info in list_checkpoints(output_dir):
        path = info.path / TRAINER_STATE
        if not path.is_file():
            continue
        try:
            recorded = json.loads(path.read_text(encoding="utf-8")).get("stage")
        except json.JSONDecodeError:
            continue
        if recorded != stage:
            raise ResumeError(
                f"{output_dir} already holds {recorded!r} checkpoints ({info.name}) and this launch is {stage!r}; "
                "a run never loads another stage into the same output directory: choose a new output_dir "
                f"and start from {info.path} with --init-checkpoint"
            )

# --------------------------------------------------------------------------- what the checkpoint holds


def inspect_saved_parts(ckpt_dir: str | os.PathLike, world_size: int | None = None) -> dict[str, bool]:
    """Which of model / optimizer / scheduler / rng state a checkpoint really holds.

    Needed because DeepSpeed itself does not fail closed: with ZeRO optimizer files missing,
    ``load_checkpoint`` only warns and rebuilds the optimizer from the 16-bit weights. Runs
    without a model, so an incomplete checkpoint is refused before anything is allocated.
    """
    ckpt = Path(ckpt_dir)
    ranks = world_size if world_size is not None else int(read_trainer_state(ckpt)["world_size"])
    tag_dir = ckpt / ENGINE_TAG
    states = engine_states(ckpt)  # mmap: only the small optimizer/scheduler entries are read
    found = {"model": states is not None, "optimizer": False, "scheduler": False,
             "rng": all(rng_path(ckpt, r).is_file() for r in range(ranks))}
    if states is None:
        return found
    found["scheduler"] = states.get("lr_scheduler") is not None
    optim_files = {p.name for p in tag_dir.glob("*_optim_states.pt")}
    if optim_files:  # ZeRO / bf16 optimizer: one partition file per data-parallel rank
        found["optimizer"] = all(any(name.startswith((f"zero_pp_rank_{r}_", f"bf16_zero_pp_rank_{r}_"))
                                     for name in optim_files) for r in range(ranks))
    else:
        found["optimizer"] = states.get("optimizer") is not None
    return found


def is_reshard(saved_state: Mapping[str, Any], world_size: int, requested: bool, ep_size: int = 1) -> bool:
    """True when ``--reshard`` was given and the checkpoint was saved with another world size or
    ``parallel.ep_size``; with the same layout a ``--reshard`` resume is an ordinary exact resume."""
    saved_ep = _flatten(saved_state.get("training_critical") or {}).get("parallel.ep_size", 1)
    return bool(requested) and (int(saved_state["world_size"]) != int(world_size) or saved_ep != ep_size)
