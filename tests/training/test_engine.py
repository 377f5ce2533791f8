"""Parameter groups and the refusals made before any engine is built."""

import pytest

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.training.config import load_config
from ds_trhash.training.engine import EngineError, check_runnable, param_groups


def test_no_decay_on_norms_and_vectors_decay_on_matrices():
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups["decay"]["params"]}
    plain = {names[id(p)] for p in groups["no_decay"]["params"]}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert "embed_tokens.weight" in decayed
    assert "layers.0.mlp.engine.expert_gate" in decayed
    assert all("norm" in n for n in plain) and "norm.weight" in plain
    assert "layers.0.self_attn.q_norm.weight" in plain
    assert decayed | plain == set(names.values())


def test_frozen_parameters_are_left_out_and_all_frozen_is_refused():
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    for n, p in model.named_parameters():
        p.requires_grad = "q_proj" in n
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == model.config.num_layers
    for p in model.parameters():
        p.requires_grad = False
    with pytest.raises(EngineError, match="no trainable parameters"):
        param_groups(model, 0.1)


def _cfg(tmp_path, **sets):
    return load_config("ds_configs/tiny/pretrain.yaml", [f"{k}={v}" for k, v in sets.items()])


def test_zero3_with_moe_layers_is_refused_before_training(tmp_path):
    from ds_trhash.training.config import ConfigError

    with pytest.raises((EngineError, ConfigError), match="ZeRO-3|zero.stage"):
        check_runnable(_cfg(tmp_path, **{"zero.stage": 3}), world_size=1)


def test_expert_parallel_size_must_divide_world(tmp_path):
    cfg = _cfg(tmp_path, **{"parallel.ep_size": 2})
    with pytest.raises(EngineError, match="does not divide the world size 3"):
        check_runnable(cfg, world_size=3)
    check_runnable(_cfg(tmp_path, **{"parallel.ep_size": 2, "zero.stage": 1}), world_size=2)  # EP needs ZeRO 1/2


def test_hardware_is_described_from_the_machine():
    from ds_trhash.training.engine import describe_hardware

    text = describe_hardware()
    assert text.startswith("CPU: ") or " x " in text
