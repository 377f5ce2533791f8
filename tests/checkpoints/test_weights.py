"""The weights loader (weights only, LoRA merge) and a real DeepSpeed save / exact resume."""
import json
import os

import pytest
import torch

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import CheckpointError, inspect_saved_parts, verify
from ds_trhash.checkpoints.weights import load_weights_only
from ds_trhash.checkpoints.stages import Stage
from ds_trhash.training.engine import without_shared_memory_op
from ds_trhash.deepspeed_command import free_port
from tests.checkpoints.helpers import save


# --------------------------------------------------------------------------- weights only


def test_weights_only_from_safetensors_export(tmp_path):
    from safetensors.torch import save_file

    weights = {"embed_tokens.weight": torch.randn(5, 3), "route_table": torch.arange(6).reshape(2, 3)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    sd, record = load_weights_only(tmp_path)
    assert record.stage is None and record.path == str(tmp_path)
    assert all(torch.equal(sd[k], v) for k, v in weights.items()) and set(sd) == set(weights)
    (tmp_path / "run.json").write_text(json.dumps({"stage": "refinement", "plan_fingerprint": "ab",
                                                   "family": "language"}))
    _, record = load_weights_only(tmp_path)
    assert record.stage is Stage.REFINEMENT and record.plan_fingerprint == "ab" and record.lora is False


def test_weights_only_refuses_unknown_or_damaged_sources(tmp_path):
    with pytest.raises(CheckpointError, match="neither a ds-trhash checkpoint.*nor an export"):
        load_weights_only(tmp_path)
    path = save(tmp_path, 3)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=r"cannot initialise from .*incomplete \(MANIFEST.json missing\)"):
        load_weights_only(path)


# --------------------------------------------------------------------------- real DeepSpeed


@pytest.fixture(scope="module")
def deepspeed_env():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _engine(zero_stage):
    import deepspeed

    torch.manual_seed(zero_stage)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    config = {"train_batch_size": 1, "zero_optimization": {"stage": zero_stage}}
    with without_shared_memory_op():  # as the trainer starts DeepSpeed on CPU: nothing to compile
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _train_step(engine):
    loss = engine(torch.ones(1, 4)).pow(2).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_real_deepspeed_checkpoint_weights_only_and_exact_resume(tmp_path, deepspeed_env, zero_stage, capfd):
    engine = _engine(zero_stage)
    _train_step(engine)
    path = save(tmp_path, 1, write_engine_state=lambda tmp: engine.save_checkpoint(str(tmp), tag=ck.ENGINE_TAG))
    assert verify(path) == (True, "ok")
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    # Weights only: ZeRO-1 goes through DeepSpeed's consolidator, stage 0 through the module file;
    # the consolidator draws no progress bar per file it reads (a launch's console stays readable)
    capfd.readouterr()
    sd, record = load_weights_only(path)
    quiet = capfd.readouterr()
    assert "%|" not in quiet.err + quiet.out and "Loading checkpoint shards" not in quiet.err, quiet.err
    assert record.stage is Stage.PRETRAINING and record.plan_fingerprint == "f" * 64
    assert set(sd) == set(saved) and all(torch.equal(sd[k], saved[k]) and sd[k].dtype == torch.float32 for k in sd)

    # Exact resume: training on moves weights, optimizer and schedule; the load brings all back.
    assert inspect_saved_parts(path) == dict.fromkeys(ck.REQUIRED_STATE_PARTS, True)
    lr_saved = engine.get_lr()
    _train_step(engine)
    continued = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    assert not torch.equal(continued["0.weight"], saved["0.weight"])
    _train_step(engine)
    ck.load_engine_state(engine, path)
    assert all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    assert engine.get_lr() == lr_saved
    _train_step(engine)  # same step from the restored Adam moments and schedule: same weights
    assert all(torch.equal(v, continued[k]) for k, v in engine.module.state_dict().items())
    if zero_stage == 0:  # no partition files: the whole optimizer state loads as saved
        ck.load_engine_state(engine, path, reshard=True)
    else:  # partitioned optimizer state needs the universal conversion, set at initialize time
        with pytest.raises(CheckpointError, match="load_universal=True"):
            ck.load_engine_state(engine, path, reshard=True)


def test_load_merged_weights_folds_lora_adapters_with_the_recorded_alpha(tmp_path):
    import json as _json

    from safetensors.torch import save_file

    from ds_trhash.model import TRHashConfig, TRHashForCausalLM
    from ds_trhash.model.lora import apply_lora, has_lora_state, merge_lora
    from ds_trhash.checkpoints.weights import load_merged_weights
    from ds_trhash.training.config import LoraSection

    torch.manual_seed(0)
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    apply_lora(model, LoraSection(enabled=True, rank=4, alpha=8.0, dropout=0.0))
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            torch.nn.init.normal_(p)  # non-zero adapters, so merging changes the base tensors
    src = tmp_path / "lora-export"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    (src / "run.json").write_text(_json.dumps({"stage": "supervised-finetuning", "lora": True,
                                               "training_critical": {"lora.alpha": 8.0}}))
    merged, record = load_merged_weights(src)
    assert not has_lora_state(merged) and record.stage.value == "supervised-finetuning"
    expected = merge_lora(model)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)

    (src / "run.json").write_text(_json.dumps({"stage": "supervised-finetuning", "lora": True}))
    with pytest.raises(CheckpointError, match="records no lora.alpha"):
        load_merged_weights(src)
