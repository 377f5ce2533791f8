import dataclasses
import json

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM


def test_200m_preset_has_the_released_parameter_count():
    cfg = TRHashConfig.from_preset("200m")
    assert cfg == TRHashConfig()
    with torch.device("meta"):
        model = TRHashForCausalLM(cfg)
    # the tied head is counted once; route tables are buffers, not parameters
    assert sum(p.numel() for p in model.parameters()) == 201_194_368
    assert all(p.is_meta for p in model.parameters())


def test_200m_defaults_follow_the_spec():
    cfg = TRHashConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (32000, 896, 16)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (14, 2, 64)
    assert (cfg.shared_width, cfg.num_experts, cfg.expert_width, cfg.top_k) == (3072, 4, 64, 2)
    assert cfg.route_weights == (0.5, 0.5) and (cfg.shared_scale, cfg.routed_scale) == (1.0, 2.0)
    assert cfg.route_seed == 0x71D5A17 and cfg.route_method == "token_id_multi_hash"
    assert cfg.loss_chunk_tokens == 1024 and cfg.max_seq_len == 2048


def test_tiny_preset():
    cfg = TRHashConfig.from_preset("tiny")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (128, 4, 4, 2, 32)
    assert (cfg.vocab_size, cfg.num_experts, cfg.expert_width, cfg.shared_width, cfg.max_seq_len) == (
        4096, 4, 16, 256, 256)


def test_unknown_preset_lists_the_allowed_names():
    with pytest.raises(ValueError, match=r"'huge'.*\['200m', 'tiny'\]"):
        TRHashConfig.from_preset("huge")


def test_preset_overrides_are_validated():
    assert TRHashConfig.from_preset("tiny", num_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        TRHashConfig.from_preset("tiny", num_kv_heads=3)


def test_dict_roundtrip_through_json():
    cfg = TRHashConfig.from_preset("tiny", route_weights=(0.7, 0.3))
    again = TRHashConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and isinstance(again.route_weights, tuple)


def test_from_dict_names_unknown_keys():
    data = TRHashConfig().to_dict() | {"hiden_size": 10, "zeta": 1}
    with pytest.raises(ValueError, match=r"\['hiden_size', 'zeta'\]"):
        TRHashConfig.from_dict(data)


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 13, "multiple of num_kv_heads"),
    ("top_k", 3, "top_k must be 2"),
    ("num_experts", 1, r"num_experts must be in \[2, 8\]"),
    ("num_experts", 9, r"num_experts must be in \[2, 8\]"),
    ("head_dim", 63, "even"),
    ("route_weights", (1.0,), "route_weights"),
    ("route_method", "learned", "route_method"),
    ("vocab_size", 0, "vocab_size must be a positive integer"),
])
def test_invalid_configs_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        TRHashConfig(**{field: value})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TRHashConfig().hidden_size = 1


@pytest.mark.parametrize("config", [TRHashConfig(), TRHashConfig.from_preset("tiny", route_weights=(0.7, 0.6))])
def test_hugging_face_fields_convert_back_exactly(config):
    hf = config.to_hf_fields()
    assert hf["intermediate_size"] == config.num_experts * config.expert_width
    assert TRHashConfig.from_hf_fields(hf) == config
    assert TRHashConfig.from_saved({"model_type": "tr_hash_moe", **hf}) == config
    assert TRHashConfig.from_saved(config.to_dict()) == config


def test_the_published_config_form_derives_head_dim_and_route_weights():
    """The released Hugging Face config states neither head_dim nor the secondary route weight."""
    published = {"vocab_size": 32000, "hidden_size": 896, "num_hidden_layers": 16, "num_attention_heads": 14,
                 "num_key_value_heads": 2, "intermediate_size": 256, "shared_intermediate_size": 3072,
                 "num_experts": 4, "num_experts_per_tok": 2, "top_k_primary_weight": 0.5, "route_hash_count": 2,
                 "shared_output_scale": 1.0, "routed_output_scale": 2.0, "max_position_embeddings": 2048}
    assert TRHashConfig.from_hf_fields(published) == TRHashConfig()
    with pytest.raises(ValueError, match="lacks"):
        TRHashConfig.from_hf_fields({"hidden_size": 896})
