"""The steps of a stage after its plan, in process: the model the plan asks for, and the
trainer-state record every checkpoint of the launch writes. (The whole stage runs through the
launcher in test_launch.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds_trhash.training import loop
from ds_trhash.training.preparation.plan import plan_launch
from ds_trhash.data.stage import StageData
from ds_trhash.training.entrypoint import build_arg_parser, launch_config, launch_request
from ds_trhash.training.trainer import build_model, start_writing, state_recorder
from tests.training.callbacks import fakes


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    args = build_arg_parser().parse_args(
        ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(root / "run"), "--max-steps", "4"])
    plan = plan_launch(launch_config(request := launch_request(args)), request, rank=0, world=1)
    start_writing(plan, rank=0)  # the shard cache and the plan's reader, reading step 0 from now on
    try:
        yield plan, build_model(plan, rank=0)
    finally:
        plan.data.loader.close()  # what the trainer's finally closes


def test_the_model_runs_the_planned_kernels(planned):
    plan, model = planned
    assert model.config == plan.model_config and next(model.parameters()).device.type == plan.device.type
    assert not hasattr(model, "kernels_requested")  # the plan says which kernels; nothing is attached to the model
    assert {engine.backend for engine in model.engines()} == {plan.kernels.experts}
    assert model.loss_backend == plan.kernels.loss


def test_trainer_state_records_the_plan_and_the_step(planned):
    plan, model = planned
    record = state_recorder(plan, model)
    st = loop.TrainState(step=2, total_steps=4, epochs_done=0, tokens_seen=2048, supervised_seen=2000)
    doc = record(st, "token pack", {"eval": None})
    assert doc["step"] == 2 and doc["total_steps"] == 4 and doc["reason"] == "token pack" and doc["eval"] is None
    assert doc["data_cursor"] == plan.data.loader.cursor(2) and doc["pack_index"] == plan.checkpoints.pack_of.get(2)
    assert doc["model_config"] == plan.model_config.to_dict() and doc["init_checkpoint"] is None
    assert doc["backends_used"] == model.backends_used()
    assert isinstance(doc["peak_memory"], dict) and doc["hardware"].startswith("1 process(es); rank 0 on ")


class _Opening(fakes.Loader):
    """Records the step each ``open`` starts reading at."""

    def __init__(self):
        super().__init__()
        self.opened = []

    def open(self, first_step):
        self.opened.append(first_step)


def test_the_stage_starts_reading_its_first_step_before_the_model_is_built():
    """``start_writing`` opens the stage's loader at its first step (a resume's saved step), so
    its shards are fetched while the model and engine are built."""
    loader = _Opening()
    for saved in (None, {"step": 7}):
        data = StageData(loader=loader, total_steps=10)
        start_writing(SimpleNamespace(data=data, output=SimpleNamespace(damaged=[], saved=saved)), rank=0)
    assert loader.opened == [0, 7]
