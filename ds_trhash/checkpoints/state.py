"""What a checkpoint is made of: its file names, its errors and the trainer state it records.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/`` holding the DeepSpeed engine files under
``state/``, one RNG file per rank under ``rng/``, ``trainer_state.json`` (the typed
``TrainerState`` plus whatever the trainer adds) and ``MANIFEST.json`` (size and SHA-256 of
every other file, written last). See docs/contracts.md, "Checkpoints and resume".
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_trhash.errors import UserError
from ds_trhash.io import read_json_object

CHECKPOINTS = "checkpoints"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
ENGINE_TAG = "state"
MANIFEST_FORMAT = "ds-trhash-checkpoint-manifest-v1"
_STEP_DIR = re.compile(r"^step_(\d{8})$")

Log = Callable[[str], None]


class CheckpointError(UserError, RuntimeError):
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


def describe_hardware() -> str:
    """The accelerator of this machine, else its CPU model (for checkpoints and run records)."""
    # a broken CUDA install or an unreadable /proc must not stop a checkpoint or a report
    with contextlib.suppress(RuntimeError):
        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            return f"{torch.cuda.device_count()} x " + " / ".join(names)
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    return "CPU: " + (platform.processor() or platform.machine() or "unknown model")


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
    return read_json_object(Path(ckpt_dir) / TRAINER_STATE, CheckpointError,
                            missing=f"{ckpt_dir} is not a complete checkpoint")

