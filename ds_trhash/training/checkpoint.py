"""Crash-safe checkpoints and the rules for resuming from them (SPEC §4).

A checkpoint directory either exists complete, with a manifest that proves every byte, or
does not exist at all: everything is written into ``step_<N>.tmp`` and renamed by rank 0 only
after every rank has finished and the manifest (written last) has been fsynced. A crash at
any point leaves at most a ``*.tmp*`` directory, which listings ignore and rotation removes.

The DeepSpeed engine is never imported here: its ``save_checkpoint`` is passed in as a
callable, so the crash-safety rules are tested with a fake writer, and the trainer calls::

    save_checkpoint(output_dir, step,
                    write_engine_state=lambda tmpdir: engine.save_checkpoint(tmpdir, tag=ENGINE_TAG),
                    trainer_state=state, rank=rank, world_size=world_size, barrier=dist.barrier)

and resumes with ``engine.load_checkpoint(str(info.path), tag=ENGINE_TAG)`` after
``resolve_resume`` and ``check_resume_compatible`` have accepted the checkpoint.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_trhash.training.rng import rng_path, save_rng_state
from ds_trhash.training.stages import SourceRecord

CHECKPOINTS = "checkpoints"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
ENGINE_TAG = "state"
MANIFEST_FORMAT = "ds-trhash-checkpoint-manifest-v1"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HASH_CHUNK = 1 << 22

Log = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or trusted; the message says which and why."""


class ResumeError(CheckpointError):
    """A resume that would not be an exact continuation of the saved run."""


# --------------------------------------------------------------------------- trainer state


def _framework_version() -> str:
    try:
        from importlib.metadata import version

        return version("ds-trhash")
    except Exception:
        return "unknown"


def _framework_commit() -> str | None:
    """The commit the trainer ran from, for the run record; None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip() or None
    except Exception:
        return None


@dataclass
class TrainerState:
    """Everything besides tensors that an exact resume (or the stage guard) needs to know."""

    stage: str
    step: int
    epoch: int
    data_cursor: int
    world_size: int
    training_critical: dict[str, Any]
    plan_fingerprint: str | None
    plan_sha256: str | None
    backends_used: dict[str, Any]
    lora: bool
    family: str
    pack_index: int | None = None
    framework_version: str = field(default_factory=_framework_version)
    framework_commit: str | None = field(default_factory=_framework_commit)
    complete: bool = False
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, where: str = TRAINER_STATE) -> "TrainerState":
        names = [f.name for f in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in doc]
        if missing:
            raise CheckpointError(f"{where} lacks {', '.join(missing)}; it was not written by this trainer "
                                  "version and cannot be resumed exactly")
        return cls(**{k: doc[k] for k in names if k in doc})


def read_trainer_state(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(ckpt_dir) / TRAINER_STATE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; {ckpt_dir} is not a complete checkpoint") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from exc


# --------------------------------------------------------------------------- files and hashes


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Directory entries (new files, renames) survive power loss only once the directory is synced."""
    _fsync_file(path)


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(root: Path) -> dict[str, Path]:
    """Every regular file below root keyed by its POSIX relative path, the manifest excluded."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != MANIFEST:
            found[rel] = path
    return found


def _synced_entries(root: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file below root (the manifest excluded), each fsynced first."""
    entries = {}
    for rel, path in _files_under(root).items():
        _fsync_file(path)
        entries[rel] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return entries


def _fsync_tree(root: Path) -> None:
    """Every directory below root, deepest first, then root: their entries survive power loss."""
    for sub in sorted({p.parent for p in root.rglob("*")} | {root}, key=lambda p: len(p.parts), reverse=True):
        _fsync_dir(sub)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINTS


# --------------------------------------------------------------------------- writing


def _state_doc(trainer_state: TrainerState | Mapping[str, Any]) -> dict[str, Any]:
    """The trainer_state.json document: the typed fields, validated, plus any extra keys the
    trainer records (tokens seen, the plan document, the model config, ...)."""
    if isinstance(trainer_state, TrainerState):
        return trainer_state.to_dict()
    return {**dict(trainer_state), **TrainerState.from_dict(trainer_state).to_dict()}


def _finalize(tmp: Path, final: Path, doc: dict[str, Any], world_size: int) -> None:
    """Rank 0, after every rank wrote its files: state, fsync, manifest last, atomic rename."""
    absent = [r for r in range(world_size) if not rng_path(tmp, r).is_file()]
    if absent:
        raise CheckpointError(f"ranks {absent} wrote no RNG state into {tmp}; the checkpoint is incomplete "
                              "and was not published")
    doc = {**doc, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    _write_json(tmp / TRAINER_STATE, doc)
    _write_json(tmp / MANIFEST, {"format": MANIFEST_FORMAT, "step": doc["step"], "files": _synced_entries(tmp)})
    _fsync_tree(tmp)
    if final.exists():  # re-save of the same step: swap atomically, then drop the old copy
        aside = final.with_name(final.name + ".tmp-replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


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
) -> Path:
    """Write checkpoint ``step`` on every rank; it becomes visible only when complete.

    All ranks must call this collectively (DeepSpeed's save is itself collective). The
    temporary directory name is the same on every rank so that all of them write into it.
    ``trainer_state`` may be a plain dict: it must hold every ``TrainerState`` field without a
    default, and extra keys are kept.
    """
    doc = _state_doc(trainer_state)
    if doc["step"] != step or doc["world_size"] != world_size:
        raise CheckpointError(
            f"trainer_state says step {doc['step']}, world size {doc['world_size']} but the save is "
            f"for step {step}, world size {world_size}; build the state from the same counters"
        )
    root = checkpoints_root(output_dir)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
        tmp.mkdir()
    barrier()
    write_engine_state(tmp)
    save_rng_state(tmp, rank, rng_state)
    barrier()
    if rank == 0:
        _finalize(tmp, final, doc, world_size)
    barrier()
    return final


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    has_manifest: bool

    @property
    def name(self) -> str:
        return self.path.name

    def __fspath__(self) -> str:
        """Usable wherever a path is: ``read_trainer_state(info)``, ``Path(info)``."""
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def list_checkpoints(output_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Published step directories, oldest first; ``*.tmp*`` directories are never listed."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append(CheckpointInfo(int(match.group(1)), child, (child / MANIFEST).is_file()))
    return sorted(found, key=lambda c: c.step)


def verify(ckpt_dir: str | os.PathLike, *, deep: bool = True) -> tuple[bool, str]:
    """(ok, reason). ``deep=False`` checks presence and sizes only (cheap, for rotation).

    Reasons read after "<name> is ...": they start with "incomplete" or "corrupt".
    """
    ckpt = Path(ckpt_dir)
    if not ckpt.is_dir():
        return False, f"incomplete ({ckpt} is not a directory)"
    if not (ckpt / MANIFEST).is_file():
        return False, f"incomplete ({MANIFEST} missing)"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))
        listed = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"corrupt ({MANIFEST} unreadable: {exc})"
    present = _files_under(ckpt)
    missing = sorted(set(listed) - set(present))
    extra = sorted(set(present) - set(listed))
    if missing:
        return False, f"corrupt ({', '.join(missing)} listed in {MANIFEST} but missing)"
    if extra:
        return False, f"corrupt ({', '.join(extra)} not listed in {MANIFEST})"
    if TRAINER_STATE not in listed:
        return False, f"incomplete ({TRAINER_STATE} missing)"
    for rel, entry in listed.items():
        size = present[rel].stat().st_size
        if size != entry.get("size"):
            return False, f"corrupt ({rel} has {size} bytes, {MANIFEST} says {entry.get('size')})"
    if deep:
        for rel, entry in listed.items():
            if _sha256(present[rel]) != entry.get("sha256"):
                return False, f"corrupt ({rel} SHA-256 differs from {MANIFEST})"
    try:
        complete = read_trainer_state(ckpt).get("complete") is True
    except CheckpointError as exc:
        return False, f"corrupt ({exc})"
    if not complete:
        return False, f"incomplete ({TRAINER_STATE} is not marked complete)"
    return True, "ok"


def find_resumable(output_dir: str | os.PathLike, log: Log = print) -> CheckpointInfo | None:
    """The newest checkpoint that fully verifies; newer broken ones are reported and skipped."""
    skipped: list[tuple[CheckpointInfo, str]] = []
    for info in reversed(list_checkpoints(output_dir)):
        ok, reason = verify(info.path)
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
    ok, reason = verify(path)
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
# The per-rank batch layout: free under --reshard as long as the global batch is unchanged.
RESHARD_LAYOUT_KEYS = ("batch.micro_batch", "batch.grad_accum")


def global_batch(flat_critical: Mapping[str, Any], world_size: int) -> tuple[int, int, int, int] | None:
    """(rows per optimizer step, micro_batch, grad_accum, world_size), or None when the settings
    do not say (a checkpoint of another trainer version)."""
    mb, ga = flat_critical.get("batch.micro_batch"), flat_critical.get("batch.grad_accum")
    if not isinstance(mb, int) or not isinstance(ga, int):
        return None
    return mb * ga * world_size, mb, ga, world_size


def _describe_global_batch(g: tuple[int, int, int, int] | None, world_size: int) -> str:
    if g is None:
        return f"unknown (no batch.micro_batch / batch.grad_accum recorded, {world_size} ranks)"
    return f"{g[0]} rows per step (micro_batch {g[1]} × grad_accum {g[2]} × {g[3]} rank{'s' if g[3] != 1 else ''})"


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
    """
    problems: list[str] = []
    state = TrainerState.from_dict(saved_state)
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
    old, new = _flatten(state.training_critical), _flatten(current)
    layout_keys: tuple[str, ...] = ()
    if reshard:
        layout_keys = RESHARD_LAYOUT_KEYS
        before_g, after_g = global_batch(old, state.world_size), global_batch(new, world_size)
        # Settings without any batch layout (neither side records one) leave nothing to compare;
        # one side without it cannot prove the global batch unchanged and is refused.
        if (before_g, after_g) != (None, None) and (before_g is None or after_g is None or before_g[0] != after_g[0]):
            problems.append(
                f"global batch: checkpoint {_describe_global_batch(before_g, state.world_size)}, this run "
                f"{_describe_global_batch(after_g, world_size)} — --reshard keeps the global batch (the data "
                "order, the step count and the schedule depend on it); choose batch.micro_batch and "
                f"batch.grad_accum with micro_batch·grad_accum·{world_size} = "
                f"{before_g[0] if before_g else '?'}")
        ep = old.get("parallel.ep_size", 1)
        if state.world_size != world_size and isinstance(ep, int) and ep > 1:
            problems.append(
                f"parallel.ep_size: the checkpoint is expert-parallel (ep_size {ep}); --reshard does not move "
                "expert-parallel state (DeepSpeed's universal conversion skips its per-expert files) — relaunch "
                f"with {state.world_size} ranks, or start a new stage from it with --init-checkpoint")
    for key in sorted(set(old) | set(new)):
        if key in layout_keys:
            continue
        before, after = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if before != after:
            problems.append(f"{key}: checkpoint {before!r}, this run {after!r}")
    if plan_sha256 is not None and state.plan_sha256 != plan_sha256:
        problems.append(f"plan_sha256: checkpoint {state.plan_sha256!r}, this run {plan_sha256!r} — the replay "
                        "plan file changed; a changed plan is a new stage")
    if state.step >= total_steps:
        problems.append(f"step: checkpoint is at step {state.step}, at or past the end of this run "
                        f"({total_steps} steps) — nothing is left to train")
    for part in REQUIRED_STATE_PARTS:
        if found is not None and not found.get(part, False):
            problems.append(f"{part}: no {part} state was found in the checkpoint — a resume never restarts it")
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ResumeError(
            f"cannot resume: {len(problems)} difference(s) from the checkpoint at step {state.step}:\n{listing}\n"
            "A resume is exact continuation. Changed settings make a new stage: use a new output_dir and "
            "--init-checkpoint (weights only)."
        )


def check_output_dir_stage(output_dir: str | os.PathLike, stage: str) -> None:
    """Refuse to write one stage's checkpoints beside another's (SPEC §4): a later RESUME=auto
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


# --------------------------------------------------------------------------- engine state


def inspect_saved_parts(ckpt_dir: str | os.PathLike, world_size: int | None = None) -> dict[str, bool]:
    """Which of model / optimizer / scheduler / rng state a checkpoint really holds.

    Needed because DeepSpeed itself does not fail closed: with ZeRO optimizer files missing,
    ``load_checkpoint`` only warns and rebuilds the optimizer from the 16-bit weights. Runs
    without a model, so an incomplete checkpoint is refused before anything is allocated.
    """
    import torch

    ckpt = Path(ckpt_dir)
    ranks = world_size if world_size is not None else int(read_trainer_state(ckpt)["world_size"])
    tag_dir = ckpt / ENGINE_TAG
    # expert-parallel runs add per-expert layer_*_expert_* files beside the engine's own
    model_files = sorted(p for p in tag_dir.glob("*model_states.pt") if not p.name.startswith("layer_"))
    found = {"model": bool(model_files), "optimizer": False, "scheduler": False,
             "rng": all(rng_path(ckpt, r).is_file() for r in range(ranks))}
    if not model_files:
        return found
    # mmap: the weights in this file are not read, only the small optimizer/scheduler entries.
    states = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=False)
    found["scheduler"] = states.get("lr_scheduler") is not None
    optim_files = {p.name for p in tag_dir.glob("*_optim_states.pt")}
    if optim_files:  # ZeRO / bf16 optimizer: one partition file per data-parallel rank
        found["optimizer"] = all(any(name.startswith((f"zero_pp_rank_{r}_", f"bf16_zero_pp_rank_{r}_"))
                                     for name in optim_files) for r in range(ranks))
    else:
        found["optimizer"] = states.get("optimizer") is not None
    return found


def _partition_files(tag_dir: Path) -> list[Path]:
    """ZeRO / bf16-optimizer partition files: one per data-parallel rank that saved."""
    return sorted(tag_dir.glob("*_optim_states.pt"))


def is_reshard(saved_state: Mapping[str, Any], world_size: int, requested: bool) -> bool:
    """True when ``--reshard`` was given and the checkpoint was saved with another world size;
    with the same world size a ``--reshard`` resume is an ordinary exact resume."""
    return bool(requested) and int(saved_state["world_size"]) != int(world_size)


def needs_universal(ckpt_dir: str | os.PathLike) -> bool:
    """Whether a reshard of this checkpoint goes through DeepSpeed's universal format.

    The optimizer state of ZeRO 1/2 (and of the bf16 optimizer) is partitioned over the ranks
    that saved it and must be re-cut for the new world size. Without partition files (ZeRO
    stage 0) every rank held the whole optimizer state, which loads on any world size as is.
    The answer decides the DeepSpeed config (``checkpoint.load_universal``), which DeepSpeed
    reads only in ``deepspeed.initialize``; pass it to ``build_engine(..., load_universal=...)``.
    """
    return bool(_partition_files(Path(ckpt_dir) / ENGINE_TAG))


RESHARD_DIR = "reshard"
UNIVERSAL_RECORD = "UNIVERSAL.json"
UNIVERSAL_FORMAT = "ds-trhash-universal-v1"


def universal_dir_for(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the universal copy of checkpoint ``step`` is built: ``<output_dir>/reshard/step_<N>``,
    outside ``checkpoints/`` so that it is never listed, verified, rotated or synced as one."""
    return Path(output_dir) / RESHARD_DIR / step_dir_name(step)


def _universal_record_ok(target: Path, source_manifest_sha: str) -> tuple[bool, str]:
    """A finished conversion of exactly this source, every file present with its recorded hash."""
    record_path = target / UNIVERSAL_RECORD
    if not record_path.is_file():
        return False, f"{UNIVERSAL_RECORD} missing"
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        files = record["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return False, f"{UNIVERSAL_RECORD} unreadable ({exc})"
    if record.get("format") != UNIVERSAL_FORMAT or record.get("source_manifest_sha256") != source_manifest_sha:
        return False, "converted from another checkpoint (manifest hash differs)"
    present = {rel: path for rel, path in _files_under(target).items() if rel != UNIVERSAL_RECORD}
    if set(present) != set(files):
        return False, "its files differ from its record"
    for rel, entry in files.items():
        if present[rel].stat().st_size != entry.get("size") or _sha256(present[rel]) != entry.get("sha256"):
            return False, f"{rel} differs from its record"
    return True, "ok"


def _run_ds_to_universal(source_tag_dir: Path, out_tag_dir: Path, log_path: Path) -> None:
    """DeepSpeed's own ZeRO -> universal converter (``deepspeed.checkpoint.ds_to_universal``),
    in this process: one worker (no process pool forked from a rank holding a process group),
    its prints captured into ``convert.log``."""
    import argparse
    import contextlib

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source_tag_dir), output_folder=str(out_tag_dir),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    with open(log_path, "w", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        ds_to_universal.main(args)


def convert_to_universal(
    ckpt_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    rank: int = 0,
    barrier: Callable[[], Any] = lambda: None,
    log: Log = print,
) -> Path:
    """Rank 0 converts a verified checkpoint to DeepSpeed's universal format; all ranks return
    the folder to load (``<output_dir>/reshard/step_<N>``, engine files under ``state/``).

    Fail-closed like every other load: the source manifest is verified (sizes and SHA-256)
    right before the conversion; the conversion is written into ``step_<N>.tmp`` and renamed
    only after ``UNIVERSAL.json`` (the source manifest's hash and the size and SHA-256 of every
    converted file) is on disk. A finished conversion of the same source is reused. Collective:
    every rank calls it; an error on rank 0 is raised there and reported on the others.
    """
    ckpt = Path(ckpt_dir)
    step = int(read_trainer_state(ckpt)["step"])
    target = universal_dir_for(output_dir, step)
    error: BaseException | None = None
    if rank == 0:
        try:
            ok, reason = verify(ckpt)
            if not ok:
                raise ResumeError(f"cannot reshard {ckpt}: it is {reason}")
            source_sha = _sha256(ckpt / MANIFEST)
            if target.parent.is_dir():  # conversions interrupted by a crash
                for stale in target.parent.iterdir():
                    if ".tmp" in stale.name and stale.is_dir():
                        shutil.rmtree(stale)
            reuse, why = _universal_record_ok(target, source_sha) if target.is_dir() else (False, "absent")
            if reuse:
                log(f"--reshard: reusing the universal conversion {target}")
            else:
                if target.exists():
                    log(f"--reshard: discarding {target} ({why}); converting again")
                    _remove(target)
                tmp = target.with_name(target.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                t0 = time.perf_counter()
                log(f"--reshard: converting {ckpt} to DeepSpeed's universal format in {target}")
                try:
                    _run_ds_to_universal(ckpt / ENGINE_TAG, tmp / ENGINE_TAG, tmp / "convert.log")
                except Exception as exc:
                    tail = (tmp / "convert.log").read_text(encoding="utf-8", errors="replace")[-2000:] \
                        if (tmp / "convert.log").is_file() else ""
                    raise CheckpointError(f"DeepSpeed's universal conversion of {ckpt} failed: {exc!r}\n{tail}") from exc
                _write_json(tmp / UNIVERSAL_RECORD, {
                    "format": UNIVERSAL_FORMAT, "source": str(ckpt.resolve()), "source_manifest_sha256": source_sha,
                    "step": step, "source_world_size": int(read_trainer_state(ckpt)["world_size"]),
                    "files": _synced_entries(tmp)})
                _fsync_tree(tmp)
                os.replace(tmp, target)
                _fsync_dir(target.parent)
                log(f"--reshard: converted in {time.perf_counter() - t0:.1f}s")
        except BaseException as exc:  # reach the barrier first, so no rank waits forever
            error = exc
    barrier()
    if error is not None:
        raise error
    if not (target / UNIVERSAL_RECORD).is_file():
        raise CheckpointError(f"rank 0 did not produce the universal conversion {target} of {ckpt}; "
                              "see rank 0's error")
    return target


def reshard_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank ``rank`` after a reshard at ``step``: a pure function of the three."""
    digest = hashlib.sha256(f"ds-trhash-reshard-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed_rng_for_reshard(seed: int, step: int, rank: int) -> int:
    """Per-rank RNG states are not portable across world sizes (rank r of the new layout has
    no predecessor), so after a reshard every generator of every rank (python, numpy, torch
    CPU, all CUDA) is seeded from (seed, step, rank). Deterministic, but not the generator
    stream of the uninterrupted run: random draws after the resume (dropout, LoRA dropout)
    differ from it. Returns the seed used."""
    import random

    import numpy as np
    import torch

    value = reshard_rng_seed(seed, step, rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # also seeds every CUDA generator
    return value


def reshard_report(saved_state: Mapping[str, Any], current: Mapping[str, Any], world_size: int) -> str:
    """What a reshard restored and what it could not, for the log of rank 0."""
    old_world = int(saved_state["world_size"])
    g = global_batch(_flatten(current), world_size)
    rows = f"{g[0]} rows per step" if g else "the global batch"
    return (
        f"--reshard: step {saved_state['step']} of a {old_world}-rank run resumed on {world_size} rank(s). Restored: "
        f"weights, optimizer (fp32 master weights and Adam moments, re-partitioned for {world_size} rank(s)), scheduler, step and data cursor (global row {saved_state.get('data_cursor', '?')}; {rows}, "
        "unchanged, so every later step reads the rows it would have read). Not restorable across world sizes: the "
        "per-rank RNG states (python, numpy, torch, CUDA); every rank was re-seeded from (seed, step, rank), so "
        f"random draws after this point differ from an uninterrupted {old_world}-rank run, and the loss is not "
        "bit-identical to it (gradients are reduced over another layout)."
    )


def _load_saved_module(engine: Any, ckpt: Path) -> None:
    """The module state as saved, strictly, before a universal load.

    DeepSpeed's universal load restores only the parameters its optimizer holds (from
    ``zero/<name>/fp32.pt``) and skips the module state dict, so buffers and frozen parameters
    (the base weights of LoRA mode) would keep the values of the freshly built model. The
    ordinary resume loads this file strictly; so does a reshard, and the universal load then
    sets every trainable parameter from its fp32 master copy.
    """
    import torch

    files = sorted((ckpt / ENGINE_TAG).glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ResumeError(f"cannot reshard {ckpt}: no mp_rank_*_model_states.pt under {ENGINE_TAG}/")
    # Our own verified checkpoint: DeepSpeed pickles non-tensor objects beside the weights.
    module = torch.load(files[0], map_location="cpu", weights_only=False).get("module")
    if module is None:
        raise ResumeError(f"cannot reshard {ckpt}: {files[0].name} holds no module state")
    try:
        engine.module.load_state_dict(module, strict=True)
    except RuntimeError as exc:
        raise ResumeError(f"cannot reshard {ckpt}: its module state does not fit this model: {exc}") from exc


def load_engine_state(
    engine: Any,
    ckpt_dir: str | os.PathLike,
    *,
    reshard: bool = False,
    output_dir: str | os.PathLike | None = None,
    rank: int = 0,
    barrier: Callable[[], Any] = lambda: None,
    log: Log = print,
) -> None:
    """Restore a DeepSpeed engine: weights, optimizer and scheduler, or an error.

    ``reshard=False``: exact resume from the files as saved (same world size).
    ``reshard=True`` (``--reshard`` onto another world size): a checkpoint with ZeRO partition
    files is converted by ``convert_to_universal`` under ``output_dir`` (collective: pass this
    rank and a barrier) and loaded through DeepSpeed's universal path, which re-partitions the
    fp32 master weights and the Adam moments for the new world size; the engine must have been
    built with ``load_universal=True`` (``needs_universal``). A checkpoint without partition
    files (ZeRO 0) holds the whole optimizer state and loads as is. The universal folder is
    removed once every rank has loaded it.
    """
    ckpt = Path(ckpt_dir)
    found = inspect_saved_parts(ckpt)
    missing = [part for part in REQUIRED_STATE_PARTS if not found[part]]
    if missing:
        raise ResumeError(f"cannot resume from {ckpt}: no {', '.join(missing)} state in it; a resume never "
                          "restarts what it cannot restore (use --init-checkpoint for weights only)")
    if reshard and any((ckpt / ENGINE_TAG).glob("layer_*_expert_*_model_states.pt")):
        raise ResumeError(f"cannot reshard {ckpt}: it is expert-parallel, and DeepSpeed's universal conversion "
                          "skips the per-expert files; resume it with the world size it was saved with")
    universal_engine = bool(getattr(engine, "load_universal_checkpoint", lambda: False)())
    universal = reshard and needs_universal(ckpt)
    if universal != universal_engine:
        if universal:
            raise CheckpointError(
                f"--reshard of {ckpt} needs DeepSpeed's universal load, but the engine was built without "
                "\"checkpoint\": {\"load_universal\": true}; build it with build_engine(..., load_universal=True) "
                "(DeepSpeed reads this setting only at initialize)")
        raise CheckpointError(f"the engine was built for a universal load, but {ckpt} is loaded as saved; build "
                              "it without load_universal")
    load_dir, cleanup = ckpt, None
    if universal:
        if output_dir is None:
            raise CheckpointError("load_engine_state(reshard=True) needs output_dir for the universal conversion")
        load_dir = cleanup = convert_to_universal(ckpt, output_dir, rank=rank, barrier=barrier, log=log)
        _load_saved_module(engine, ckpt)
    load_path, _ = engine.load_checkpoint(str(load_dir), tag=ENGINE_TAG, load_module_strict=True,
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise ResumeError(f"DeepSpeed loaded nothing from {load_dir / ENGINE_TAG}; the checkpoint cannot be resumed")
    if cleanup is not None:
        barrier()  # every rank has read it
        if rank == 0:
            _remove(cleanup)
            try:
                cleanup.parent.rmdir()  # reshard/ itself, when nothing else is in it
            except OSError:
                pass


# --------------------------------------------------------------------------- rotation


def _remove(path: Path) -> None:
    """Rename out of the listing first, so a half-deleted checkpoint is never mistaken for one."""
    doomed = path.with_name(path.name + ".tmp-deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def rotate(
    output_dir: str | os.PathLike,
    keep_last: int,
    protect: Iterable[int] = (),
    log: Log = print,
) -> list[Path]:
    """Delete old checkpoints beyond the newest ``keep_last`` and stale ``*.tmp*`` directories.

    Never deleted: the newest checkpoint that verifies (size check), any protected step (pack
    boundaries, epoch ends, anything not yet synced), any directory without a manifest (left
    for a person to inspect), and anything when no checkpoint verifies. Rank 0 only, after a
    save has returned.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}: the newest checkpoint is always kept")
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for child in sorted(root.iterdir()):
        if ".tmp" in child.name and child.is_dir():
            shutil.rmtree(child)
            log(f"removed stale temporary directory {child.name}")
            removed.append(child)
    listed = list_checkpoints(output_dir)
    newest_ok = next((c for c in reversed(listed) if c.has_manifest and verify(c.path, deep=False)[0]), None)
    if newest_ok is None:
        return removed
    complete = [c for c in listed if c.has_manifest]
    keep = {c.step for c in complete[-keep_last:]} | set(protect) | {newest_ok.step}
    for info in listed:
        if not info.has_manifest:
            log(f"left {info.name} in place: it has no {MANIFEST} (incomplete); inspect or delete it by hand")
        elif info.step not in keep and info.step < newest_ok.step:
            _remove(info.path)
            log(f"rotated out {info.name}")
            removed.append(info.path)
    return removed


# --------------------------------------------------------------------------- graceful stop


class GracefulStop:
    """SIGTERM/SIGINT set ``should_stop`` instead of killing the process mid-step.

    The loop polls the flag after each optimizer step, writes a checkpoint and exits cleanly.
    A second signal raises KeyboardInterrupt: the operator insists, so stop now, without a
    checkpoint (the previous complete one remains). Previous handlers come back on exit.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT), log: Log = print) -> None:
        self.signals = tuple(signals)
        self.log = log
        self.should_stop = False
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.should_stop:
            raise KeyboardInterrupt(f"second {name}: stopping now without a checkpoint")
        self.should_stop = True
        self.received = name
        self.log(f"{name} received: finishing the current step, writing a checkpoint, then exiting "
                 "(send it again to stop at once)")

    def __enter__(self) -> "GracefulStop":
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as exc:
            self.__exit__(None, None, None)
            raise CheckpointError(f"GracefulStop must be entered in the main thread: {exc}") from exc
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# --------------------------------------------------------------------------- weights-only init


def _engine_weights(ckpt_dir: Path) -> dict[str, Any]:
    """Full fp32 weights from the DeepSpeed files, whatever the ZeRO stage.

    ZeRO 1-3 keep the fp32 master weights partitioned in ``zero_pp_rank_*_optim_states.pt``;
    DeepSpeed's consolidator reassembles them. Stage 0 writes no such files (the consolidator
    fails on it), and there the module state dict in ``mp_rank_00_model_states.pt`` is the
    whole model; in bf16/fp16 it holds the low-precision copy the forward used.
    """
    import torch

    tag_dir = ckpt_dir / ENGINE_TAG
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} is missing: {ckpt_dir} holds no engine state")
    from ds_trhash.model.expert_parallel import consolidate_checkpoint, expert_files

    if expert_files(tag_dir):
        # Expert-parallel: DeepSpeed's consolidator cannot read the per-expert files; stack
        # them back into the SPEC names (the module copies: bf16 in a bf16 run).
        module = consolidate_checkpoint(tag_dir)
        return {k: (v.float() if v.is_floating_point() else v) for k, v in module.items()}
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=ENGINE_TAG))
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if not model_file.is_file():
        raise CheckpointError(f"{model_file} is missing: no model weights in {ckpt_dir}")
    # Our own verified checkpoint: DeepSpeed pickles non-tensor objects beside the weights.
    module = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
    return {k: (v.float() if v.is_floating_point() else v) for k, v in module.items()}


def read_source_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """What an --init-checkpoint source says about itself: our trainer_state.json, or an
    export's trainer_state.json / run.json; {} when it says nothing (the guard then refuses)."""
    for name in (TRAINER_STATE, "run.json"):
        meta = Path(path) / name
        if meta.is_file():
            try:
                return json.loads(meta.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{meta} is not valid JSON ({exc})") from exc
    return {}


def read_source_record(path: str | os.PathLike) -> SourceRecord:
    return SourceRecord.from_mapping(read_source_metadata(path), path=str(path))


def load_weights_only(path: str | os.PathLike) -> tuple[dict[str, Any], SourceRecord]:
    """Weights for ``--init-checkpoint``: no optimizer, scheduler, step or RNG comes along.

    Accepts a checkpoint directory of ours (verified first) or an exported SafeTensors
    directory. The returned record is what the stage guard judges the launch by; an export
    without trainer_state.json/run.json has no recorded stage, and the guard refuses it.
    """
    src = Path(path)
    if (src / MANIFEST).is_file() or (src / ENGINE_TAG).is_dir():
        ok, reason = verify(src)
        if not ok:
            raise CheckpointError(f"cannot initialise from {src}: it is {reason}")
        return _engine_weights(src), read_source_record(src)
    weights = src / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(str(weights)), read_source_record(src)
    raise CheckpointError(
        f"{src} is neither a ds-trhash checkpoint ({MANIFEST} + {ENGINE_TAG}/) nor an export "
        "(model.safetensors); point --init-checkpoint at checkpoints/step_<N> or an export directory"
    )


def load_merged_weights(path: str | os.PathLike) -> tuple[dict[str, Any], SourceRecord]:
    """``load_weights_only`` with LoRA adapters folded into the base tensors.

    Whatever consumes weights outside their own LoRA run (the next stage's initialisation, an
    export, an evaluation) needs plain released tensor names; the adapters are merged with the
    source run's own alpha, never dropped. A LoRA source that records no alpha is refused.
    """
    from ds_trhash.model.lora import has_lora_state, merge_lora_state_dict

    state, record = load_weights_only(path)
    if not has_lora_state(state):
        return state, record
    alpha = (read_source_metadata(path).get("training_critical") or {}).get("lora.alpha")
    if alpha is None:
        raise CheckpointError(
            f"{path} holds LoRA adapters but records no lora.alpha, so they cannot be merged exactly; "
            "use a checkpoint written by this trainer (its trainer_state.json records the LoRA settings)")
    try:
        return dict(merge_lora_state_dict(state, alpha)), record
    except ValueError as exc:
        raise CheckpointError(f"cannot merge the LoRA adapters of {path}: {exc}") from None
