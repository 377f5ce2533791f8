"""SafeTensors export of a trained model, loadable by transformers (docs/contracts.md §9).

This module writes an export: the files ``manifest`` lists (that module also reads and
verifies one). It is built in a hidden temporary directory beside ``out_dir``, the weights are
read back from disk and compared tensor by tensor with what was meant to be written, and only
then is the directory renamed into place. A failed export leaves nothing at ``out_dir``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ds_trhash import outputs
from ds_trhash.checkpoints import MANIFEST, CheckpointError, read_trainer_state
from ds_trhash.checkpoints.stages import Stage, StageError
from ds_trhash.checkpoints.weights import load_merged_weights
from ds_trhash.data.sft.chat import CHAT_TEMPLATE_JINJA
from ds_trhash.io import fsync_path, publish_dir, sha256_file, write_json
from ds_trhash.release.export.manifest import (CONFIG, EXPORT_FORMAT, EXPORT_MANIFEST, RUN, TOKENIZER, WEIGHTS,
                                               ExportError, export_files, read_export_manifest, verify_export)
from ds_trhash.release.export.tensors import compare_tensors, parse_dtype, prepare_tensors
from ds_trhash.release.hf import bundle as hf_bundle

# the export directory's names and its check, importable from here as before
__all__ = ["CONFIG", "EXPORT_FORMAT", "EXPORT_MANIFEST", "RUN",
           "TOKENIZER", "WEIGHTS", "ExportError", "export_checkpoint", "export_files", "export_safetensors",
           "parse_dtype", "read_export_manifest", "verify_export"]

# --------------------------------------------------------------------------- small helpers


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    """Read the written weights from disk (a seam: tests replace it to simulate corruption)."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _save_weights(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    """``save_file``, then the header's metadata put in sorted key order: safetensors writes it
    from a hash map whose order changes from process to process, and an export of the same
    checkpoint must be the same bytes (its SHA-256 is what sync, the record and a user compare)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=dict(metadata))
    with open(path, "r+b") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size).decode("utf-8"))
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > size:  # the same keys and values: never longer; refuse rather than corrupt
            raise ExportError(f"{path}: the safetensors header could not be rewritten in sorted order")
        fh.seek(8)
        fh.write(text + b" " * (size - len(text)))


# --------------------------------------------------------------------------- export


def _copy_tokenizer(tokenizer_dir: str | os.PathLike, dest: Path) -> None:
    src = Path(tokenizer_dir)
    file = src / TOKENIZER if src.is_dir() else src
    if not file.is_file():
        raise ExportError(f"no {TOKENIZER} at {src}; pass the directory the tokenizer was trained into")
    shutil.copyfile(file, dest / TOKENIZER)


def _chat_template_text(chat_template: str | os.PathLike | None) -> str:
    """Jinja text: the project's complexity-chat-v2 by default, a string as given, a file's text."""
    if chat_template is None:
        return CHAT_TEMPLATE_JINJA
    if isinstance(chat_template, os.PathLike):
        src = Path(chat_template)
        if not src.is_file():
            raise ExportError(f"chat template file {src} does not exist")
        return src.read_text(encoding="utf-8")
    if isinstance(chat_template, str):
        return chat_template
    raise ExportError(f"chat_template must be Jinja text or the path of a Jinja file, "
                      f"got {type(chat_template).__name__}")


def _refuse_existing(out: Path) -> None:
    outputs.check_dir_target("--out", out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty; an export never overwrites: choose a new directory")


def _export_stage(stage: str | None) -> str | None:
    """The stage's canonical name, or None; a name that is no stage is an ``ExportError`` like any
    other refusal of an export."""
    if stage is None:
        return None
    try:
        return Stage.parse(stage, what="export stage").value
    except StageError as exc:
        raise ExportError(str(exc)) from None


def _write_weights(tmp: Path, tensors: Mapping[str, torch.Tensor], dtype_name: str, stage: str | None) -> Path:
    """Write ``model.safetensors`` and read it back from disk: an export is published only if every
    tensor on disk equals the one meant to be written."""
    weights = tmp / WEIGHTS
    _save_weights(tensors, weights, {"format": "pt", "producer": EXPORT_FORMAT, "dtype": dtype_name,
                                     "stage": str(stage)})
    fsync_path(weights)
    compare_tensors(tensors, _read_back(weights))
    return weights


def _write_bundle(tmp: Path, model_config: Mapping[str, Any], dtype_name: str, run_doc: Mapping[str, Any],
                  template: str, tokenizer_dir: str | os.PathLike | None) -> None:
    """The files beside the weights that make the folder loadable by transformers: model code and
    config, run.json, the chat template and, when given, the tokenizer."""
    hf_bundle.write_model_files(tmp, model_config, dtype_name)
    write_json(tmp / RUN, run_doc, fsync=False)
    hf_bundle.write_chat_template(tmp, template)
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, tmp)
        hf_bundle.write_tokenizer_files(tmp, template, model_config["max_seq_len"])


def _export_manifest(tmp: Path, weights: Path, tensors: Mapping[str, torch.Tensor], dtype_name: str,
                     model_config: Mapping[str, Any], stage: str | None, created: str | None) -> dict[str, Any]:
    """The manifest of the files written into ``tmp``, each synced first so the hash recorded is
    that of what is on disk."""
    others = {}
    for path in sorted(tmp.iterdir()):
        if path.name != WEIGHTS:
            fsync_path(path)
            others[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    integer = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items() if not v.is_floating_point()}
    return {
        "format": EXPORT_FORMAT,
        "created": created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "weights": {"file": WEIGHTS, "sha256": sha256_file(weights), "size": weights.stat().st_size,
                    "dtype": dtype_name, "tensors": len(tensors), "integer_tensors": integer},
        "vocab_size": model_config["vocab_size"],
        "stage": stage,
        "tokenizer": others.get(TOKENIZER, {}).get("sha256"),
        "chat_template": hf_bundle.CHAT_TEMPLATE_FILE,
        "files": others,
    }


def _publish_export(tmp: Path, manifest: Mapping[str, Any], out: Path) -> None:
    """Write the manifest last, then rename the finished folder to ``out`` in one step, so a reader
    sees either no export or a whole one."""
    write_json(tmp / EXPORT_MANIFEST, manifest, fsync=False)
    fsync_path(tmp / EXPORT_MANIFEST)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; an export is meant to be read
    fsync_path(tmp)
    try:
        publish_dir(tmp, out, replace=False)  # atomic; replaces only an empty directory
    except OSError as exc:
        raise ExportError(f"cannot move the export into {out}: {exc}") from None


def export_safetensors(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    model_config: Mapping[str, Any],
    tokenizer_dir: str | os.PathLike | None = None,
    chat_template: str | os.PathLike | None = None,
    stage: str | None = None,
    extra_meta: Mapping[str, Any] | None = None,
    created: str | None = None,
) -> dict[str, Any]:
    """Write a verified export of ``state_dict`` to ``out_dir`` and return its manifest.

    ``chat_template`` (Jinja text or a file of it) defaults to the complexity-chat-v2 template.
    ``created`` (the manifest's time) defaults to now; an export of a checkpoint passes the
    checkpoint's own, so exporting it twice writes the same bytes.
    """
    out = Path(out_dir)
    _refuse_existing(out)
    dtype_name, float_dtype = parse_dtype(dtype)
    stage = _export_stage(stage)
    if extra_meta and ("stage" in extra_meta or "lora" in extra_meta):
        raise ExportError("extra_meta may not set 'stage' or 'lora'; pass stage= (LoRA exports are always merged)")
    tensors = prepare_tensors(state_dict, model_config, float_dtype)
    template = _chat_template_text(chat_template)
    run_doc = {**dict(extra_meta or {}), "stage": stage, "lora": False, "export_dtype": dtype_name}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        weights = _write_weights(tmp, tensors, dtype_name, stage)
        _write_bundle(tmp, model_config, dtype_name, run_doc, template, tokenizer_dir)
        manifest = _export_manifest(tmp, weights, tensors, dtype_name, model_config, stage, created)
        _publish_export(tmp, manifest, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- from a checkpoint


def _check_tokenizer(tok: str | os.PathLike | None, recorded: str | None, *, explicit: bool, force: bool,
                     ckpt: Path) -> dict[str, str] | None:
    """Refuse to copy a tokenizer other than the run's; returns the forced record, if any."""
    if tok is None or not recorded:
        return None
    src = Path(tok)
    file = src / TOKENIZER if src.is_dir() else src
    if not file.is_file():
        raise ExportError(f"no {TOKENIZER} at {src}; pass the directory the tokenizer was trained into")
    actual = sha256_file(file)
    if actual == recorded:
        return None
    if explicit and force:
        return {"copied_sha256": actual, "recorded_sha256": recorded, "tokenizer": str(file)}
    how = ("pass --force-tokenizer to export with it anyway (recorded in run.json)" if explicit
           else "the file changed since training; pass --tokenizer DIR with the run's tokenizer")
    raise ExportError(f"{file} has sha256 {actual[:12]}…, but {ckpt} was trained with tokenizer {recorded[:12]}…; {how}")


def _source_record(ckpt: Path, trainer_state: Mapping[str, Any],
                   forced: dict[str, str] | None) -> dict[str, Any]:
    """What run.json keeps of the checkpoint an export came from: the next stage's guards, the
    evaluation and a reader downstream need it without the checkpoint at hand."""
    manifest_path = ckpt / MANIFEST
    extra = {
        "source_checkpoint": str(ckpt),
        "source_step": trainer_state.get("step"),
        # a stage cut short by --max-steps stays recognisable downstream (checkpoints.capped_by)
        "total_steps": trainer_state.get("total_steps"),
        "planned_steps": trainer_state.get("planned_steps"),
        "source_manifest_sha256": sha256_file(manifest_path) if manifest_path.is_file() else None,
        "source_lora": bool(trainer_state.get("lora")),
        "family": trainer_state.get("family"),
        "plan_fingerprint": trainer_state.get("plan_fingerprint"),
        # what the next stage's guard compares: the exact unique core, and the tokenizer identity
        "plan_doc": trainer_state.get("plan_doc"),
        "tokenizer_sha256": trainer_state.get("tokenizer_sha256"),
        "framework_commit": trainer_state.get("framework_commit"),
        "backends_used": trainer_state.get("backends_used"),
        # what `ds-trhash eval heldout` packs the eval partition with by default
        "packing_policy": (trainer_state.get("training_critical") or {}).get("data.packing.policy"),
    }
    if forced is not None:
        extra["tokenizer_forced"] = forced
    return extra


def export_checkpoint(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    chat_template: str | os.PathLike | None = None,
    force_tokenizer: bool = False,
) -> dict[str, Any]:
    """Export a verified training checkpoint (``checkpoints/step_<N>``).

    The stage, model config, tokenizer directory and LoRA flag come from its trainer_state.json;
    ``tokenizer_dir`` overrides the recorded one. The tokenizer copied must be the one the run
    recorded (its SHA-256): token ids mean nothing under another. An explicit ``tokenizer_dir``
    that differs needs ``force_tokenizer`` and is recorded as forced in run.json.
    """

    ckpt = Path(ckpt_dir)
    outputs.refuse_overlap("--out", out_dir, "--checkpoint", ckpt)  # an export never writes into its source
    _refuse_existing(Path(out_dir))
    parse_dtype(dtype)
    try:
        trainer_state = read_trainer_state(ckpt)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    model_config = trainer_state.get("model_config")
    if not isinstance(model_config, Mapping):
        raise ExportError(f"{ckpt}/trainer_state.json records no model_config; cannot tell the model's shape")
    tok = tokenizer_dir if tokenizer_dir is not None else trainer_state.get("tokenizer_dir")
    if tok is not None and not Path(tok).exists():
        raise ExportError(f"the tokenizer recorded for {ckpt} ({tok}) no longer exists; pass tokenizer_dir")
    forced = _check_tokenizer(tok, trainer_state.get("tokenizer_sha256"), explicit=tokenizer_dir is not None,
                              force=force_tokenizer, ckpt=ckpt)
    try:
        state, _record = load_merged_weights(ckpt)  # LoRA runs export merged: plain released names
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    stage = trainer_state.get("stage")
    extra = _source_record(ckpt, trainer_state, forced)
    return export_safetensors(state, out_dir, dtype=dtype, model_config=model_config, tokenizer_dir=tok,
                              chat_template=chat_template, stage=stage, extra_meta=extra,
                              created=trainer_state.get("created"))
