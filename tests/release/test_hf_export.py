"""An export is a transformers model: AutoConfig / AutoModelForCausalLM load it (trust_remote_code),
its logits equal the trainer's, generate uses a KV cache, and save_pretrained round-trips."""
import json
import shutil

import pytest
import torch
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from ds_trhash.model import TRHashConfig
from ds_trhash.model.attention import rope_inv_freq
from ds_trhash.release.export.writer import export_safetensors, verify_export

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_model(tiny_export):
    return AutoModelForCausalLM.from_pretrained(tiny_export.out, trust_remote_code=True).eval()


def _greedy_without_cache(model, ids, steps):
    """The trainer's model, recomputing the whole sequence for every new token."""
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_config_json_is_a_transformers_config(tiny_export):
    doc = json.loads((tiny_export.out / "config.json").read_text())
    cfg = tiny_export.config
    assert doc["model_type"] == "tr_hash_moe" and doc["architectures"] == ["TRHashForCausalLM"]
    assert doc["auto_map"] == {"AutoConfig": "configuration_tr_hash_moe.TRHashConfig",
                               "AutoModelForCausalLM": "modeling_tr_hash_moe.TRHashForCausalLM"}
    expected = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                "intermediate_size": cfg.num_experts * cfg.expert_width, "shared_intermediate_size": cfg.shared_width,
                "num_experts": cfg.num_experts, "num_experts_per_tok": 2, "top_k_primary_weight": 0.5,
                "routing_strategy": "token_id_multi_hash", "route_hash_count": 2, "shared_expert": True,
                "shared_output_scale": 1.0, "routed_output_scale": 2.0, "use_qk_norm": True, "norm_eps": 1e-6,
                "rope_theta": 10000.0, "max_position_embeddings": cfg.max_seq_len, "vocab_size": cfg.vocab_size,
                "tie_word_embeddings": True, "eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 2}
    assert {k: doc[k] for k in expected} == expected
    assert TRHashConfig.from_saved(doc) == cfg  # the trainer rebuilds its own config exactly
    auto = AutoConfig.from_pretrained(tiny_export.out, trust_remote_code=True)
    assert (auto.model_type, auto.num_hidden_layers, auto.eos_token_id) == ("tr_hash_moe", cfg.num_layers, 0)
    gen = json.loads((tiny_export.out / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["pad_token_id"]) == (0, 1)
    weights = load_file(str(tiny_export.out / "model.safetensors"))
    inv_freq = weights["layers.0.self_attn.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (cfg.head_dim // 2,)
    assert verify_export(tiny_export.out) == (True, "ok")


def test_logits_equal_the_trainer_model(tiny_export, hf_model):
    torch.manual_seed(1)
    ids = torch.randint(0, tiny_export.config.vocab_size, (3, 37))
    with torch.no_grad():
        ours, theirs = tiny_export.model(ids), hf_model(ids).logits
    assert theirs.shape == ours.shape and (theirs - ours).abs().max().item() <= TOL
    # routing is the checkpoint's (layer 1 was shifted away from the config's tables), not rebuilt
    engine = hf_model.layers[1].mlp.engine
    assert torch.equal(engine.route_table, tiny_export.state["layers.1.mlp.engine.route_table"])


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_rows_equal_each_row_alone(tiny_export, hf_model, side):
    torch.manual_seed(2)
    lengths = [23, 9, 16]
    width = max(lengths)
    rows = [torch.randint(4, tiny_export.config.vocab_size, (n,)) for n in lengths]
    ids = torch.full((len(rows), width), 1)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    with torch.no_grad():
        logits = hf_model(ids, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = tiny_export.model(row[None])[0]
            got = logits[i, width - len(row):] if side == "left" else logits[i, :len(row)]
            assert (got - alone).abs().max().item() <= TOL, (side, i)


def test_generate_with_kv_cache_equals_greedy_recomputation(tiny_export, hf_model):
    torch.manual_seed(3)
    prompt = torch.randint(4, tiny_export.config.vocab_size, (1, 11))
    seen = []
    hook = hf_model.embed_tokens.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            cached = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                       do_sample=False, eos_token_id=None, pad_token_id=1)
    finally:
        hook.remove()
    assert seen == [11] + [1] * 11  # the prompt once, then one new token per step: the cache is used
    reference = _greedy_without_cache(tiny_export.model, prompt, 12)
    assert torch.equal(cached, reference)
    assert len(set(cached[0, 11:].tolist())) > 3  # a model that repeats one token would prove nothing
    with torch.no_grad():
        uncached = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False,
                                     eos_token_id=None, pad_token_id=1)
    assert torch.equal(uncached, reference)


def test_left_padded_batch_generates_what_each_prompt_does_alone(tiny_export, hf_model):
    torch.manual_seed(4)
    short, long = torch.randint(4, 512, (1, 5)), torch.randint(4, 512, (1, 9))
    ids = torch.cat([torch.cat([torch.ones(1, 4, dtype=torch.long), short], 1), long])
    mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()
    with torch.no_grad():
        batch = hf_model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=1)
    assert torch.equal(batch[0, 4:], _greedy_without_cache(tiny_export.model, short, 6)[0])
    assert torch.equal(batch[1], _greedy_without_cache(tiny_export.model, long, 6)[0])


def test_save_pretrained_reloads_with_equal_logits(tiny_export, hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "saved")
    names = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"config.json", "model.safetensors", "configuration_tr_hash_moe.py", "modeling_tr_hash_moe.py"} <= names
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
    ids = torch.randint(0, tiny_export.config.vocab_size, (2, 19))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf_model(ids).logits)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert torch.equal(saved["layers.1.mlp.engine.route_table"], tiny_export.state["layers.1.mlp.engine.route_table"])


def test_missing_route_tables_are_refused_not_rebuilt(tiny_export, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_export.out, broken)
    weights = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("layers.0.mlp.engine.route_table")},
              str(broken / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.engine\.route_table is not a valid routing"):
        model(torch.tensor([[5, 6, 7]]))


def test_bfloat16_export_keeps_rotary_frequencies_in_fp32(tiny_export, tmp_path):
    export_safetensors(tiny_export.state, tmp_path / "bf16", dtype="bfloat16",
                       model_config=tiny_export.config.to_dict())
    weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert weights["layers.0.self_attn.rotary_emb.inv_freq"].dtype == torch.float32
    assert weights["embed_tokens.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"  # 4.5x spelling
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", trust_remote_code=True, **{dtype_kw: torch.bfloat16})
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    exact = rope_inv_freq(tiny_export.config.head_dim, tiny_export.config.rope_theta)
    for loaded in (model, model.float().to(torch.bfloat16)):  # loading, and casting the loaded model
        assert torch.equal(loaded.layers[0].self_attn.rotary_emb.frequencies(), exact)
