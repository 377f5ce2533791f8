"""What an export directory holds and how a reader checks it (docs/contracts.md §9).

An export directory holds::

    model.safetensors       every tensor; float weights in one dtype, route buffers in their
                            integer dtypes (int64 / uint8 / int32), each layer's
                            self_attn.rotary_emb.inv_freq in fp32, all vocabulary rows
    config.json             Hugging Face config (model_type tr_hash_moe, auto_map); converts
                            back with TRHashConfig.from_saved
    configuration_tr_hash_moe.py, modeling_tr_hash_moe.py
                            the transformers code (trust_remote_code), see release/hf/
    generation_config.json  eos / pad / bos ids
    run.json                {"stage": ..., "lora": false, ...}: what --init-checkpoint reads
    tokenizer.json          copied from the run's tokenizer directory (when known), with
    tokenizer_config.json,  special_tokens_map.json  (bos/eos/pad/unk, chat_template)
    chat_template.jinja     the chat template (complexity-chat-v2 unless another is given)
    export_manifest.json    written last: weights SHA-256 / size / dtype / tensor count and
                            the SHA-256 and size of every other file

``verify_export`` checks that the manifest lists exactly the files present, with their sizes
and (``deep``) hashes. This module exists apart from ``writer`` so that what reads an export
(sync, cleanup, final/, the run record, the watcher) shares the names and the check without the
writing (tensors, the model layout, the transformers bundle) that only ``writer`` needs.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.run_source import EXPORT_MANIFEST
from ds_trhash.errors import UserError
from ds_trhash.io import read_json_object, sha256_file

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
RUN = "run.json"
TOKENIZER = "tokenizer.json"
EXPORT_FORMAT = "ds-trhash-export-v1"


class ExportError(UserError, RuntimeError):
    """An export that cannot be written or trusted; nothing is left at the destination."""


def read_export_manifest(export_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed export_manifest.json; an ``ExportError`` when it is missing or not a JSON object."""
    return read_json_object(Path(export_dir) / EXPORT_MANIFEST, ExportError,
                            missing=f"{export_dir} is not a complete export")


def export_files(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every file the manifest vouches for (the weights included), name -> {sha256, size}."""
    weights = manifest["weights"]
    return {weights["file"]: {"sha256": weights["sha256"], "size": weights["size"]}, **manifest["files"]}


def verify_export(export_dir: str | os.PathLike, *, deep: bool = True) -> tuple[bool, str]:
    """(ok, reason): the manifest lists exactly the files present, with their sizes and hashes."""
    root = Path(export_dir)
    try:
        manifest = read_export_manifest(root)
        listed = export_files(manifest)
    except (ExportError, KeyError, TypeError) as exc:
        return False, f"incomplete ({exc})"
    present = {p.name for p in root.iterdir() if p.is_file() and p.name != EXPORT_MANIFEST}
    if set(listed) != present:
        return False, (f"corrupt (files differ from {EXPORT_MANIFEST}: missing {sorted(set(listed) - present)}, "
                       f"unlisted {sorted(present - set(listed))})")
    for name, entry in listed.items():
        path = root / name
        if path.stat().st_size != entry["size"]:
            return False, f"corrupt ({name} has {path.stat().st_size} bytes, the manifest says {entry['size']})"
        if deep and sha256_file(path) != entry["sha256"]:
            return False, f"corrupt ({name} SHA-256 differs from {EXPORT_MANIFEST})"
    return True, "ok"
