"""What a checkpoint is made of: its file names, its errors and the trainer state it records.

A checkpoint is ``<output_dir>/checkpoints/step_<N>/`` holding the DeepSpeed engine files under
``state/``, one RNG file per rank under ``rng/``, ``trainer_state.json`` (the typed
``TrainerState``, checked on every save and resume, within the full record that
``LaunchRecord`` writes) and ``MANIFEST.json`` (size and SHA-256 of every other file, written
last). See docs/contracts.md, "Checkpoints and resume".
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds_trhash.errors import UserError
from ds_trhash.io import read_json_object

CHECKPOINTS = "checkpoints"
MANIFEST = "MANIFEST.json"
TRAINER_STATE = "trainer_state.json"
ENGINE_TAG = "state"
MANIFEST_FORMAT = "ds-trhash-checkpoint-manifest-v1"
_STEP_DIR = re.compile(r"^step_(\d{8})$")

Log = Callable[[str], None]


def rng_path(ckpt_dir: str | os.PathLike, rank: int) -> Path:
    """Where a checkpoint keeps rank ``rank``'s generators (written by ``rng.save_rng_state``)."""
    return Path(ckpt_dir) / "rng" / f"rank_{rank}.pt"


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


@dataclass(frozen=True)
class LaunchRecord:
    """What every ``trainer_state.json`` of one launch says about the launch itself.

    The stage guard of the next stage, an exact resume, export and the run record read these
    fields; :meth:`trainer_state` adds what changes from one checkpoint to the next.
    """

    stage: str
    family: str
    world_size: int
    training_critical: dict[str, Any]
    plan_fingerprint: str | None
    plan_sha256: str | None
    plan_doc: dict[str, Any] | None
    init_checkpoint: str | None
    lora: bool
    model_config: dict[str, Any]
    tokenizer_dir: str | None
    tokenizer_sha256: str | None
    tokenizer_assumed: bool  # the data recorded no tokenizer: data.tokenizer was taken as its
    sft_dir: str | None
    sft_manifest_sha256: str | None
    source_stage: str | None
    hardware: str  # "<world> process(es); rank 0 on <describe_hardware()>"
    pack_of: Mapping[int, int] = field(default_factory=dict)  # step -> token pack it closes
    output_dir: str | None = None  # resolved: a copy of a checkpoint elsewhere is another run's (--fork)
    data_source: dict[str, Any] | None = None  # {store, commit} the shards were read from
    planned_steps: int | None = None  # the steps the data holds (total_steps is less when capped)

    def trainer_state(self, *, step: int, epoch: int, total_steps: int, data_cursor: int, tokens_seen: int,
                      supervised_seen: int, backends_used: dict[str, Any], reason: str, peak_memory: dict[str, Any],
                      extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``trainer_state.json`` of the checkpoint at ``step``; ``extra`` (evaluation results,
        the kernel path of the last training step) is added last and wins."""
        return {
            "stage": self.stage,
            "family": self.family,
            "step": step,
            "epoch": epoch,  # epochs completed at this step, as in every other record
            "total_steps": total_steps,
            "planned_steps": self.planned_steps,
            "data_cursor": data_cursor,
            "tokens_seen": tokens_seen,
            "supervised_seen": supervised_seen,
            "world_size": self.world_size,
            "training_critical": self.training_critical,
            "plan_fingerprint": self.plan_fingerprint,
            "plan_sha256": self.plan_sha256,
            "plan_doc": self.plan_doc,
            "data_source": self.data_source,  # a resume reads this commit again
            "init_checkpoint": self.init_checkpoint,
            "output_dir": self.output_dir,
            "lora": self.lora,
            "backends_used": backends_used,
            "model_config": self.model_config,
            "tokenizer_dir": self.tokenizer_dir,
            "tokenizer_sha256": self.tokenizer_sha256,
            "tokenizer_assumed": self.tokenizer_assumed,  # the data recorded none: data.tokenizer was taken
            "sft_dir": self.sft_dir,
            "sft_manifest_sha256": self.sft_manifest_sha256,
            "source_stage": self.source_stage,
            "hardware": self.hardware,
            "pack_index": self.pack_of.get(step),
            "packs": len(self.pack_of) or None,
            "reason": reason,
            "save_started_unix": time.time(),  # the save took until MANIFEST.json appeared (ds-trhash smoke)
            "peak_memory": peak_memory,
            **(extra or {}),
        }


def capped_by(meta: Mapping[str, Any]) -> str | None:
    """How a run was cut short by ``--max-steps`` / ``training.max_steps``, from what a checkpoint,
    an export's run.json or a completion record says (``total_steps`` below ``planned_steps``);
    None for a run that trained everything its data holds (or that recorded neither)."""
    total, planned = meta.get("total_steps"), meta.get("planned_steps")
    if not (isinstance(total, int) and isinstance(planned, int)) or total >= planned:
        return None
    return (f"capped by --max-steps (training.max_steps) at {total} of the {planned} optimizer steps its data "
            "holds; the schedule ran over those steps and the rest of the data was never trained")


def read_trainer_state(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    return read_json_object(Path(ckpt_dir) / TRAINER_STATE, CheckpointError,
                            missing=f"{ckpt_dir} is not a complete checkpoint")

