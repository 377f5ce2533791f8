"""The weights ``--init-checkpoint`` starts the model from, read and checked with the launch's
other checks: before anything is written and before the data side (the shard cache, the stream
and its prefetch process) starts.

A checkpoint of ours is verified against its manifest as it is read (``checkpoints.weights``); the
tensors are then loaded into the model built on the meta device, which checks every name and
shape and every layer's routes as the real model would, without allocating a copy. A damaged
file or another model's weights are refused here, as one ``error:`` line, with nothing to tear
down; the model takes the same tensors later (read once).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ds_trhash.checkpoints.weights import load_merged_weights
from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.config import TRHashConfig


class InitWeights:
    """The checked weights of ``--init-checkpoint``, held until the model takes them (once)."""

    def __init__(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        self.path = str(path)
        self.route_differences: tuple[str, ...] = ()  # where its routes differ from the config's tables
        self._state: dict[str, Any] | None = state

    @property
    def where(self) -> str:
        """The source, as every message about these weights names it."""
        return f"the weights of --init-checkpoint {self.path}"

    def take(self) -> dict[str, Any]:
        """The state dict, let go of here: the plan outlives the model's start-up."""
        if self._state is None:
            raise RuntimeError(f"{self.where} were taken already")
        state, self._state = self._state, None
        return state


def read_init_weights(path: str | os.PathLike, model_cfg: TRHashConfig) -> InitWeights:
    """Read (verified), merge LoRA adapters of an SFT source, and check that they fit the model:
    raises ``CheckpointError`` (damaged, unreadable) or ``WeightsError`` (another model's)."""
    state, _ = load_merged_weights(path)
    initial = InitWeights(path, state)
    with torch.device("meta"):
        probe = TRHashForCausalLM(model_cfg)
    initial.route_differences = tuple(probe.load_checkpoint_state(state, where=initial.where, assign=True))
    return initial
