"""The one weights loader: what eval, export and ``--init-checkpoint`` read a model from.

Weights only (no optimizer, scheduler, step or RNG), from a checkpoint of ours (verified first,
whatever the ZeRO stage, expert-parallel files consolidated) or from an exported SafeTensors
directory, with LoRA adapters merged when the consumer needs plain released tensor names.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ds_trhash.checkpoints.stages import SourceRecord
from ds_trhash.checkpoints.state import ENGINE_TAG, MANIFEST, TRAINER_STATE, CheckpointError
from ds_trhash.checkpoints.store import verify
from ds_trhash.model.lora import has_lora_state, merge_lora_state_dict

# --------------------------------------------------------------------------- weights-only init


@contextlib.contextmanager
def _quiet(module: ModuleType) -> Iterator[None]:
    """DeepSpeed's consolidator draws a tqdm bar per ZeRO file it reads: in a launch's console
    (the end-of-stage export, --init-checkpoint) that is a bar per file the user did not ask for.
    Its bars are disabled while it runs (the module's own ``tqdm`` name, put back after)."""
    loud = getattr(module, "tqdm")  # a module global of DeepSpeed's, not declared to a type checker
    setattr(module, "tqdm", functools.partial(loud, disable=True))
    try:
        yield
    finally:
        setattr(module, "tqdm", loud)


def _engine_weights(ckpt_dir: Path) -> dict[str, Any]:
    """Full fp32 weights from the DeepSpeed files, whatever the ZeRO stage.

    ZeRO 1-3 keep the fp32 master weights partitioned in ``zero_pp_rank_*_optim_states.pt``;
    DeepSpeed's consolidator reassembles them. Stage 0 writes no such files (the consolidator
    fails on it), and there the module state dict in ``mp_rank_00_model_states.pt`` is the
    whole model; in bf16/fp16 it holds the low-precision copy the forward used.
    """
    tag_dir = ckpt_dir / ENGINE_TAG
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir} is missing: {ckpt_dir} holds no engine state")
    # lazy: expert_parallel imports deepspeed.moe, seconds of start-up for every non-EP reader
    from ds_trhash.model.expert_parallel import consolidate_checkpoint, expert_files

    if expert_files(tag_dir):
        # Expert-parallel: DeepSpeed's consolidator cannot read the per-expert files; stack
        # them back into the released names (the module copies: bf16 in a bf16 run).
        stacked = consolidate_checkpoint(tag_dir)
        return {k: (v.float() if v.is_floating_point() else v) for k, v in stacked.items()}
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils import zero_to_fp32

        with _quiet(zero_to_fp32):
            return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=ENGINE_TAG))
    model_file = tag_dir / "mp_rank_00_model_states.pt"
    if not model_file.is_file():
        raise CheckpointError(f"{model_file} is missing: no model weights in {ckpt_dir}")
    # Our own verified checkpoint: DeepSpeed pickles non-tensor objects beside the weights.
    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    module = saved.get("module") if isinstance(saved, dict) else None
    if not isinstance(module, dict) or not all(isinstance(v, torch.Tensor) for v in module.values()):
        # a torch file resealed into the manifest, but not an engine's record of a model
        raise CheckpointError(f"{model_file} holds no model state dict (a 'module' mapping of names to tensors): "
                              f"{ckpt_dir} is not a checkpoint this trainer wrote")
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