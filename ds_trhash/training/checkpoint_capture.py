"""DeepSpeed's save, with its state files captured in host memory instead of written.

``engine.save_checkpoint`` stays the one that decides what a checkpoint holds and where (every
rank calls it; it builds the module, ZeRO and scheduler states and names the files), but the
engine's checkpoint engine, which DeepSpeed hands each file's state to, is wrapped so that
``save`` keeps a host copy (``checkpoints.background.snapshot``) and the path instead of
writing. The background writer (``checkpoints.background``) then writes those files with
``torch.save`` as DeepSpeed's ``TorchCheckpointEngine`` does. Everything else (loading, commit, the writer
ranks) is the wrapped engine's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_trhash.checkpoints.background import PendingFile, host_snapshot


class CapturingCheckpointEngine:
    """``save`` copies the state to host memory and remembers it; ``take`` hands the files over."""

    def __init__(self, inner: object) -> None:  # DeepSpeed's checkpoint engine
        self.inner = inner
        self.zipfile = bool(getattr(inner, "zipfile_serialization", True))
        self._captured: list[PendingFile] = []

    def __getattr__(self, name: str) -> object:  # the rest of DeepSpeed's checkpoint engine, as it is
        return getattr(self.inner, name)

    def save(self, state_dict: object, path: str) -> None:
        state, _ = host_snapshot(state_dict)
        self._captured.append(PendingFile(Path(path), state, self.zipfile))

    def take(self) -> list[PendingFile]:
        captured, self._captured = self._captured, []
        return captured


def capturing(engine: object) -> CapturingCheckpointEngine | None:
    """Wrap a DeepSpeed engine's checkpoint engine (once); None for an engine without one (a
    stand-in in tests), whose ``save_checkpoint`` then writes its files itself."""
    current = getattr(engine, "checkpoint_engine", None)
    if current is None:
        return None
    if not isinstance(current, CapturingCheckpointEngine):
        current = CapturingCheckpointEngine(current)
        setattr(engine, "checkpoint_engine", current)  # DeepSpeed's engine calls it from now on
    return current
