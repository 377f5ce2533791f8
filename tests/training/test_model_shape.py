"""Models of any size from the config: the model: section's architecture fields, alone or over a
preset, each impossible combination refused at load naming its key, and the 200m preset unchanged."""
import pytest
import torch
import yaml

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.routing import build_route_table
from ds_trhash.training.config import ConfigError, dump_config, load_config, model_config, training_critical
from ds_trhash.training.preparation.footprint import count_parameters, meta_model

# a whole shape, no preset: 3 layers of width 96 (3 heads of 32), 4 experts of width 24
CUSTOM = {"vocab_size": 4096, "hidden_size": 96, "num_layers": 3, "num_heads": 3, "num_kv_heads": 1,
          "shared_width": 192, "num_experts": 4, "expert_width": 24, "max_seq_len": 256}


def _doc(model, **sections):
    return {"stage": "pretraining", "model": model, "output_dir": "runs/s",
            "data": {"seq_len": 128, "plan": "p.json"}, **sections}


def _load(tmp_path, doc, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_config(path, list(overrides))


def _refusal(tmp_path, doc, overrides=()):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, doc, overrides)
    return info.value


def test_a_shape_given_field_by_field_builds_that_model(tmp_path):
    cfg = _load(tmp_path, _doc(CUSTOM))
    mc = model_config(cfg)
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.head_dim, mc.expert_width) == (96, 3, 3, 32, 24)
    assert (mc.hash_channels, mc.route_seed) == (TRHashConfig().hash_channels, TRHashConfig().route_seed)
    torch.manual_seed(0)
    model = TRHashForCausalLM(mc)
    h, v = 96, 4096
    per_layer = (h * 96 + 2 * h * 32 + 96 * h) + 2 * 32 + 3 * h * 192 + 3 * 4 * h * 24 + 2 * h
    assert sum(p.numel() for p in model.parameters()) == v * h + 3 * per_layer + h
    # the meta count (no storage) is the real one
    assert count_parameters(cfg.parallel, meta_model(cfg, mc)).total == sum(p.numel() for p in model.parameters())
    # routes by the one rule, for this vocabulary, expert count, seed and channel count
    for layer, block in enumerate(model.layers):
        assert torch.equal(block.mlp.engine.route_table, build_route_table(v, 4, layer, mc.route_seed, 2))
    # the dumped config (config.json of a run) carries the shape and loads back to the same model
    again = _load(tmp_path, dump_config(cfg))
    assert model_config(again) == mc


def test_a_preset_with_overrides_is_the_preset_with_them_replaced(tmp_path):
    cfg = _load(tmp_path, _doc({"preset": "tiny"}), ["model.num_layers=2", "model.route_seed=7",
                                                     "model.hash_channels=3"])
    mc = model_config(cfg)
    assert mc == TRHashConfig.from_preset("tiny", num_layers=2, route_seed=7, hash_channels=3)
    # width and heads changed together: head_dim follows as hidden_size / num_heads
    wide = model_config(_load(tmp_path, _doc({"preset": "tiny", "hidden_size": 192, "num_heads": 6})))
    assert (wide.head_dim, wide.num_kv_heads) == (32, 2)
    crit = training_critical(cfg)
    assert (crit["model.num_layers"], crit["model.route_seed"], crit["model.hash_channels"]) == (2, 7, 3)
    assert "model.hidden_size" not in crit  # the preset's own value: not a difference


def test_the_200m_preset_is_the_released_model(tmp_path):
    cfg = load_config("ds_configs/200m/pretrain.yaml")
    assert model_config(cfg) == TRHashConfig(loss_chunk_tokens=cfg.kernels.loss_chunk_tokens)
    assert count_parameters(cfg.parallel, meta_model(cfg, model_config(cfg))).total == 201_194_368
    # a preset alone records no shape key, so its checkpoints resume as before
    assert not [k for k in training_critical(cfg) if k.startswith("model.") and k not in ("model.preset", "model.family")]
    # restating a preset value changes nothing
    same = load_config("ds_configs/200m/pretrain.yaml", ["model.hidden_size=896", "model.num_experts=4"])
    assert model_config(same) == model_config(cfg) and training_critical(same) == training_critical(cfg)


@pytest.mark.parametrize("model,overrides,key,needle", [
    ({**CUSTOM, "num_heads": 5}, (), "model.num_heads", "do not fit hidden_size 96"),
    ({**CUSTOM, "head_dim": 16}, (), "model.head_dim", "does not fit hidden_size 96"),
    ({"preset": "tiny", "hidden_size": 90}, (), "model.num_heads", "4 heads do not fit hidden_size 90"),
    ({**CUSTOM, "num_heads": 6, "num_kv_heads": 4, "head_dim": 16}, (), "model.num_kv_heads", "must divide num_heads 6"),
    ({**CUSTOM, "num_experts": 6}, ("parallel.ep_size=4",), "parallel.ep_size", "allowed: 1, 2, 3, 6"),
    ({"preset": "tiny"}, ("parallel.ep_size=3",), "parallel.ep_size", "allowed: 1, 2, 4"),
    ({**CUSTOM, "vocab_size": 70_000}, (), "model.vocab_size", "uint16"),
    ({**CUSTOM, "max_seq_len": 64}, (), "data.seq_len", "64-token context"),
    ({**CUSTOM, "num_experts": 9}, (), "model.num_experts", "[2, 8]"),
    ({**CUSTOM, "head_dim": 33, "num_heads": 1, "hidden_size": 33}, (), "model.head_dim", "even"),
    ({k: v for k, v in CUSTOM.items() if k != "expert_width"}, (), "model.expert_width", "required when no preset"),
    ({}, (), "model.preset", "'200m' | 'tiny'"),
    ({**CUSTOM, "hidden_size": 0}, (), "model.hidden_size", "> 0"),
])
def test_every_impossible_shape_is_refused_at_load_naming_its_key(tmp_path, model, overrides, key, needle):
    err = _refusal(tmp_path, _doc(model), overrides)
    assert err.key == key, str(err)
    assert needle in err.problem, str(err)


def test_an_override_of_the_shape_is_named_as_its_source(tmp_path):
    err = _refusal(tmp_path, _doc({"preset": "tiny"}), ["model.num_kv_heads=3"])
    assert err.key == "model.num_kv_heads" and "--set model.num_kv_heads" in err.source
    err = _refusal(tmp_path, _doc({"preset": "tiny"}), ["model.max_seq_len=64"])
    assert err.key == "data.seq_len" and "--set model.max_seq_len" in err.source
