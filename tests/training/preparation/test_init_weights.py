"""The --init-checkpoint weights as the plan reads them (training/launch/init_weights.py): verified,
read once, checked against the model built on the meta device, handed over once. Through the
launch (refused before the data side starts): tests/training/test_launch_refusals.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds_trhash.checkpoints import CheckpointError
from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.transformer import WeightsError
from ds_trhash.training.preparation.init_weights import read_init_weights
from tests.fail_closed import flip_byte, tree_digest
from tests.release.conftest import shifted_routes
from tests.release.run_fixtures import tiny_state, write_step


def test_the_checked_weights_are_the_checkpoints_and_are_handed_over_once(tmp_path):
    cfg, state = tiny_state()
    step = write_step(tmp_path, 10, cfg, shifted_routes(state, cfg, layer=0))
    before = tree_digest(tmp_path)
    initial = read_init_weights(step, cfg)
    assert initial.where == f"the weights of --init-checkpoint {step}"
    assert [line.split(":")[0] for line in initial.route_differences] == ["layer 0"]  # said when the model takes them
    taken = initial.take()
    model = TRHashForCausalLM(cfg)
    model.load_checkpoint_state(taken)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, shifted_routes(state, cfg, layer=0)[name].to(tensor.dtype)), name
    with pytest.raises(RuntimeError, match="taken already"):
        initial.take()  # the plan lets go of them: it outlives the model's start-up
    assert tree_digest(tmp_path) == before


def test_a_damaged_file_or_another_models_weights_are_refused_naming_the_source(tmp_path):
    cfg, state = tiny_state()
    other = dataclasses.replace(cfg, num_layers=2)
    step = write_step(tmp_path / "a", 10, cfg, state)
    with pytest.raises(WeightsError, match=rf"the weights of --init-checkpoint {step} do not fit this model "
                                           r"\(2 layers, hidden \d+\): .*Missing key\(s\) in state_dict: \"layers.1."):
        read_init_weights(step, other)
    flip_byte(step / "state" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=f"cannot initialise from {step}: it is corrupt"):
        read_init_weights(step, cfg)
    foreign = write_step(tmp_path / "b", 10, cfg, {"embed_tokens.weight": "not a tensor"})
    with pytest.raises(CheckpointError, match="holds no model state dict"):
        read_init_weights(foreign, cfg)
