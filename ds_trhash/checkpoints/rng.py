"""Every random generator a rank uses, captured and restored as one unit (docs/contracts.md §4).

The public pretraining checkpoints keep no RNG state, so a resumed run draws different dropout
masks and shuffles than the uninterrupted one. Here each rank saves python, numpy, torch CPU
and all CUDA generators, and a restore with any piece missing fails instead of silently
reseeding: a resume is either exact or refused.

States are stored with plain types and tensors only, so they load with
``torch.load(weights_only=True)`` and a checkpoint cannot smuggle in code.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ds_trhash.checkpoints.state import rng_path
from ds_trhash.errors import UserError


FORMAT = "ds-trhash-rng-v1"
_PIECES = ("python", "numpy", "torch_cpu", "cuda")


class RNGStateError(UserError, RuntimeError):
    """An RNG state that cannot be restored exactly; resuming would not reproduce the run."""


def capture_rng_state() -> dict[str, Any]:
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = [s.clone() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "format": FORMAT,
        "python": {"version": int(version), "state": [int(w) for w in words], "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.random.get_rng_state().clone(),
        "cuda": cuda,
    }


def _validate(state: object) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RNGStateError(f"not an RNG state of format {FORMAT!r} (found {found!r}); the checkpoint is "
                            "damaged or from another trainer, so an exact resume is impossible")
    missing = [p for p in _PIECES if p not in state]
    if missing:
        raise RNGStateError(f"RNG state lacks {', '.join(missing)}; refusing to resume with a reseeded "
                            "generator (start a new stage with --init-checkpoint instead)")
    if not isinstance(state["torch_cpu"], torch.Tensor) or state["torch_cpu"].dtype != torch.uint8:
        raise RNGStateError("RNG state 'torch_cpu' is not a uint8 tensor")
    for key in ("version", "state", "gauss"):
        if key not in state["python"]:
            raise RNGStateError(f"RNG state 'python' lacks {key!r}")
    for key in ("kind", "keys", "pos", "has_gauss", "cached_gaussian"):
        if key not in state["numpy"]:
            raise RNGStateError(f"RNG state 'numpy' lacks {key!r}")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(state["cuda"]) != have:
        raise RNGStateError(
            f"RNG state holds {len(state['cuda'])} CUDA generator(s) but this process sees {have} CUDA "
            "device(s); resume on the same hardware layout or start a new stage with --init-checkpoint"
        )


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore all generators, or none: the state is validated before anything is set."""
    _validate(state)
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.random.set_rng_state(state["torch_cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng_state(ckpt_dir: str | os.PathLike, rank: int, state: dict[str, Any] | None = None) -> Path:
    """Write this rank's generators to ``rng/rank_<rank>.pt`` (fsynced: it is part of a checkpoint)."""
    path = rng_path(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        torch.save(capture_rng_state() if state is None else state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def load_rng_state(ckpt_dir: str | os.PathLike, rank: int) -> dict[str, Any]:
    path = rng_path(ckpt_dir, rank)
    if not path.is_file():
        raise RNGStateError(f"{path} is missing: the checkpoint has no RNG state for rank {rank}; "
                            "an exact resume needs the same world size it was saved with")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RNGStateError(f"cannot read {path}: {exc}") from exc
    _validate(state)
    return state
