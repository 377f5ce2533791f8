"""Resharding: resuming on another world size through DeepSpeed's universal checkpoint format,
and restoring a DeepSpeed engine from a checkpoint (as saved, or resharded).

ZeRO 1/2 optimizer state is partitioned over the ranks that saved it; a ``--reshard`` resume on
another world size converts it once with DeepSpeed's own ``ds_to_universal`` (into
``<output_dir>/reshard/step_<N>``, outside ``checkpoints/``) and loads it through DeepSpeed's
universal path. Per-rank RNG states cannot move across world sizes; they are re-seeded from
(seed, step, rank) and the report says so.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.expert_reshard import load_by_parameter, moves_experts, saved_ep_size
from ds_trhash.checkpoints.resume import REQUIRED_STATE_PARTS, _flatten, global_batch, inspect_saved_parts
from ds_trhash.checkpoints.state import ENGINE_TAG, MANIFEST, CheckpointError, Log, ResumeError, read_trainer_state
from ds_trhash.checkpoints.store import _files_under, _synced_entries, step_dir_name, verify
from ds_trhash.engine_api import DeepSpeedEngine
from ds_trhash.io import fsync_tree, publish_dir, remove_dir, sha256_file, write_json

def _partition_files(tag_dir: Path) -> list[Path]:
    """ZeRO / bf16-optimizer partition files: one per data-parallel rank that saved."""
    return sorted(tag_dir.glob("*_optim_states.pt"))



def needs_universal(ckpt_dir: str | os.PathLike, ep_size: int = 1) -> bool:
    """Whether a reshard of this checkpoint onto ``ep_size`` goes through DeepSpeed's universal format.

    Not when either side is expert-parallel: that reshard moves every parameter by name and
    global expert id itself (``expert_reshard.py``) into an engine built as for a fresh start.

    The optimizer state of ZeRO 1/2 (and of the bf16 optimizer) is partitioned over the ranks
    that saved it and must be re-cut for the new world size. Without partition files (ZeRO
    stage 0) every rank held the whole optimizer state, which loads on any world size as is.
    The answer decides the DeepSpeed config (``checkpoint.load_universal``), which DeepSpeed
    reads only in ``deepspeed.initialize``; pass it to ``build_engine(..., load_universal=...)``.
    """
    if moves_experts(ckpt_dir, ep_size):
        return False
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
        if present[rel].stat().st_size != entry.get("size") or sha256_file(present[rel]) != entry.get("sha256"):
            return False, f"{rel} differs from its record"
    return True, "ok"


def _run_ds_to_universal(source_tag_dir: Path, out_tag_dir: Path, log_path: Path) -> None:
    """DeepSpeed's own ZeRO -> universal converter (``deepspeed.checkpoint.ds_to_universal``),
    in this process: one worker (no process pool forked from a rank holding a process group),
    its prints captured into ``convert.log``."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(source_tag_dir), output_folder=str(out_tag_dir),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    with open(log_path, "w", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
        ds_to_universal.main(args)


def _remove_interrupted_conversions(reshard_dir: Path) -> None:
    """Delete the ``*.tmp`` folders of conversions a crash interrupted: they were never published,
    and each holds a full copy of the optimizer state."""
    if reshard_dir.is_dir():
        for stale in reshard_dir.iterdir():
            if ".tmp" in stale.name and stale.is_dir():
                shutil.rmtree(stale)


def _convert_into(ckpt: Path, tmp: Path) -> None:
    """Run DeepSpeed's converter on ``ckpt`` into ``tmp``; a failure is raised with the end of
    ``convert.log``, where the converter printed what it choked on."""
    try:
        _run_ds_to_universal(ckpt / ENGINE_TAG, tmp / ENGINE_TAG, tmp / "convert.log")
    except Exception as exc:
        tail = (tmp / "convert.log").read_text(encoding="utf-8", errors="replace")[-2000:] \
            if (tmp / "convert.log").is_file() else ""
        raise CheckpointError(f"DeepSpeed's universal conversion of {ckpt} failed: {exc!r}\n{tail}") from exc


def _convert_and_publish(ckpt: Path, step: int, target: Path, source_sha: str, log: Log) -> None:
    """Convert into ``<target>.tmp`` and rename it to ``target`` only once ``UNIVERSAL.json`` (the
    source manifest's hash, every converted file's size and SHA-256) is on disk, so a half-done
    conversion is never taken for a finished one."""
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    log(f"--reshard: converting {ckpt} to DeepSpeed's universal format in {target}")
    _convert_into(ckpt, tmp)
    write_json(tmp / UNIVERSAL_RECORD, {
        "format": UNIVERSAL_FORMAT, "source": str(ckpt.resolve()), "source_manifest_sha256": source_sha,
        "step": step, "source_world_size": int(read_trainer_state(ckpt)["world_size"]),
        "files": _synced_entries(tmp)})
    fsync_tree(tmp)
    publish_dir(tmp, target, replace=False)
    log(f"--reshard: converted in {time.perf_counter() - t0:.1f}s")


def _ensure_universal(ckpt: Path, step: int, target: Path, log: Log) -> None:
    """Rank 0's part of ``convert_to_universal``: verify the source right before using it, then
    reuse a finished conversion of exactly this source or replace whatever else is at ``target``."""
    ok, reason = verify(ckpt)
    if not ok:
        raise ResumeError(f"cannot reshard {ckpt}: it is {reason}")
    source_sha = sha256_file(ckpt / MANIFEST)
    _remove_interrupted_conversions(target.parent)
    reuse, why = _universal_record_ok(target, source_sha) if target.is_dir() else (False, "absent")
    if reuse:
        log(f"--reshard: reusing the universal conversion {target}")
        return
    if target.exists():
        log(f"--reshard: discarding {target} ({why}); converting again")
        remove_dir(target)
    _convert_and_publish(ckpt, step, target, source_sha, log)


def convert_to_universal(
    ckpt_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    rank: int = 0,
    barrier: Callable[[], object] = lambda: None,
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
            _ensure_universal(ckpt, step, target, log)
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
    old_ep, new_ep = saved_ep_size(dict(saved_state)), int(_flatten(current).get("parallel.ep_size", 1))
    ep = (f" (ep_size {old_ep} -> {new_ep}: every routed expert moved by its global id with its optimizer state)"
          if max(old_ep, new_ep) > 1 else "")
    return (
        f"--reshard: step {saved_state['step']} of a {old_world}-rank run resumed on {world_size} rank(s){ep}. Restored: "
        f"weights, optimizer (fp32 master weights and Adam moments, re-partitioned for {world_size} rank(s)), scheduler, step and data cursor (global row {saved_state.get('data_cursor', '?')}; {rows}, "
        "unchanged, so every later step reads the rows it would have read). Not restorable across world sizes: the "
        "per-rank RNG states (python, numpy, torch, CUDA); every rank was re-seeded from (seed, step, rank), so "
        f"random draws after this point differ from an uninterrupted {old_world}-rank run, and the loss is not "
        "bit-identical to it (gradients are reduced over another layout)."
    )


def _engine_ep_size(engine: DeepSpeedEngine) -> int:
    """The ep_size of an engine's model (1 without expert parallelism, or without a module)."""
    module = getattr(engine, "module", None)
    modules = module.modules() if module is not None else ()
    return max((int(m.ep_size) for m in modules if getattr(m, "expert_group_name", None)), default=1)


def _load_saved_module(engine: DeepSpeedEngine, ckpt: Path) -> None:
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
    engine: DeepSpeedEngine,
    ckpt_dir: str | os.PathLike,
    *,
    reshard: bool = False,
    output_dir: str | os.PathLike | None = None,
    rank: int = 0,
    barrier: Callable[[], object] = lambda: None,
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
    if reshard and moves_experts(ckpt, _engine_ep_size(engine)):
        if getattr(engine, "load_universal_checkpoint", lambda: False)():
            raise CheckpointError("an expert-parallel --reshard loads into an engine built without load_universal; "
                                  "build it with build_engine(..., load_universal=False)")
        load_by_parameter(engine, ckpt, log=log)
        return
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
            remove_dir(cleanup)
            with contextlib.suppress(OSError):  # something else is in it: it stays
                cleanup.parent.rmdir()  # reshard/ itself, when nothing else is in it

