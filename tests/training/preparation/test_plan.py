"""The launch plan, in process: what a launch of the tiny config decides before the model exists,
and a refusal of it that leaves the output directory as it was."""
from __future__ import annotations

import pytest

from ds_trhash.data.plans.budget import BudgetError
from ds_trhash.training.callbacks import training_parts
from ds_trhash.training.preparation.plan import LaunchPlan, plan_launch
from ds_trhash.training.preparation.resources import ResourceError
from ds_trhash.training.entrypoint import build_arg_parser, launch_config, launch_request
from tests.fail_closed import tree_digest


def _plan(tmp_path, *extra: str) -> LaunchPlan:
    args = build_arg_parser().parse_args(
        ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(tmp_path / "run"), *extra])
    return plan_launch(launch_config(request := launch_request(args)), request, rank=0, world=1)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return root, _plan(root, "--max-steps", "6")


def test_a_fresh_launch_is_planned_without_writing_its_output(fresh):
    root, plan = fresh
    assert not (root / "run").exists()  # the embedded corpus is built beside it; the run writes nothing yet
    assert not plan.resuming and plan.start_step == 0 and plan.init_weights is None and plan.source is None
    assert plan.data.total_steps == 6 and plan.cfg.batch.grad_accum == 2  # 8 rows of 128 on one rank
    assert plan.layout.world_size == 1 and plan.loaded.batch.grad_accum is None
    assert plan.kernels.experts == "pytorch" and plan.device.type == "cpu"
    # each part prepared (its inputs checked) but the profiler, which this config does not ask for
    assert len(plan.builders) == len(training_parts()) - 1
    assert plan.checkpoints.pack_of == {2: 1, 4: 2, 6: 3}


def test_the_plan_is_what_every_checkpoint_records(fresh):
    _, plan = fresh
    record = plan.record()
    doc = record.trainer_state(step=4, epoch=0, total_steps=6, data_cursor=32, tokens_seen=4096, supervised_seen=4000,
                               backends_used={"experts": "pytorch"}, reason="token pack", peak_memory={},
                               extra={"backends_used": {"experts": "triton"}})
    assert doc["stage"] == "pretraining" and doc["world_size"] == 1 and doc["pack_index"] == 2 and doc["packs"] == 3
    assert doc["plan_fingerprint"] == plan.data.plan.fingerprint and doc["training_critical"] == plan.critical
    assert doc["backends_used"] == {"experts": "triton"}  # extra wins, in the key's own place
    assert list(doc)[:3] == ["stage", "family", "step"] and doc["hardware"].startswith("1 process(es); rank 0 on ")


@pytest.mark.parametrize("extra, env, error, needle", [
    ((), {"TARGET_TOKENS": "123456"}, BudgetError, "TARGET_TOKENS 123456 != the plan's trained_tokens"),
    ((), {"DS_TRHASH_TEST_DISK_FREE": "0"}, ResourceError, "cannot hold one checkpoint"),  # after the data
])
def test_a_refused_plan_changes_nothing(fresh, monkeypatch, extra, env, error, needle):
    root, _ = fresh  # the embedded corpus beside the output directory exists already (reused, never rewritten)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = tree_digest(root)
    with pytest.raises(error, match=needle):
        _plan(root, "--max-steps", "6", *extra)
    assert tree_digest(root) == before and not (root / "run").exists()
