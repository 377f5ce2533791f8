"""SafeTensors export: exact round trip, dtype rules, refusals, and weights-only init from it."""
import json

import pytest
import torch
from safetensors.torch import load_file

from ds_trhash.data.sft.chat import CHAT_TEMPLATE_JINJA
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.attention import rope_inv_freq
from ds_trhash.release.export import writer as export_mod
from ds_trhash.cli import main as cli
from ds_trhash.checkpoints.weights import load_weights_only
from ds_trhash.io import sha256_file
from ds_trhash.release.export.writer import ExportError, export_checkpoint, export_safetensors, verify_export
from tests.release.checkpoint_utils import write_checkpoint

ROUTE_DTYPES = {"route_table": torch.int64, "fused_route_codes": torch.uint8, "fused_expert_pairs": torch.int32}
HF_FILES = {"config.json", "generation_config.json", "configuration_tr_hash_moe.py", "modeling_tr_hash_moe.py"}


def rotary_keys(cfg):
    """The per-layer rotary frequencies every export adds (fp32; transformers needs them stored)."""
    return {f"layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(cfg.num_layers)}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset("tiny")
    model = TRHashForCausalLM(cfg)
    return cfg, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_is_exact_and_keeps_route_dtypes(tmp_path, tiny):
    cfg, state = tiny
    out = tmp_path / "export"
    manifest = export_safetensors(state, out, model_config=cfg.to_dict(), stage="refinement",
                                  chat_template="{{ messages }}")
    loaded = load_file(str(out / "model.safetensors"))
    assert set(loaded) == set(state) | rotary_keys(cfg)
    for key in rotary_keys(cfg):
        assert loaded[key].dtype == torch.float32 and torch.equal(loaded[key], rope_inv_freq(cfg.head_dim, cfg.rope_theta))
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    for key, value in loaded.items():
        suffix = key.rsplit(".", 1)[-1]
        if suffix in ROUTE_DTYPES:
            assert value.dtype == ROUTE_DTYPES[suffix]
    assert loaded["embed_tokens.weight"].shape[0] == cfg.vocab_size
    w = manifest["weights"]
    assert w["sha256"] == sha256_file(out / "model.safetensors")
    assert w["size"] == (out / "model.safetensors").stat().st_size
    assert (w["dtype"], w["tensors"]) == ("float32", len(state) + cfg.num_layers)
    assert set(manifest["files"]) == HF_FILES | {"run.json", "chat_template.jinja"}
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert TRHashConfig.from_saved(json.loads((out / "config.json").read_text())) == cfg
    assert json.loads((out / "run.json").read_text())["stage"] == "refinement"
    assert json.loads((out / "export_manifest.json").read_text()) == manifest
    assert verify_export(out) == (True, "ok")
    (out / "config.json").write_text("{}")
    assert not verify_export(out)[0]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary directory left


def test_bfloat16_export(tmp_path, tiny):
    cfg, state = tiny
    export_safetensors(state, tmp_path / "bf16", dtype="bfloat16", model_config=cfg.to_dict())
    loaded = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    floats = {v.dtype for k, v in loaded.items() if v.is_floating_point() and k not in rotary_keys(cfg)}
    assert floats == {torch.bfloat16}
    for key, value in state.items():
        expect = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert loaded[key].dtype == expect.dtype and torch.equal(loaded[key], expect), key


def test_tampered_reload_is_detected_and_nothing_is_left(tmp_path, tiny, monkeypatch):
    cfg, state = tiny
    real = export_mod._read_back

    def flipped(path):
        tensors = real(path)
        tensors["layers.1.mlp.engine.expert_up"][0, 0, 0] += 1.0
        return tensors

    monkeypatch.setattr(export_mod, "_read_back", flipped)
    with pytest.raises(ExportError, match="expert_up differs"):
        export_safetensors(state, tmp_path / "out", model_config=cfg.to_dict())
    assert list(tmp_path.iterdir()) == []


def test_truncated_vocabulary_and_bad_state_are_refused(tmp_path, tiny):
    cfg, state = tiny
    short = dict(state, **{"embed_tokens.weight": state["embed_tokens.weight"][:-1]})
    with pytest.raises(ExportError, match="keeps every embedding row"):
        export_safetensors(short, tmp_path / "a", model_config=cfg.to_dict())
    missing = {k: v for k, v in state.items() if not k.endswith("fused_route_codes")}
    with pytest.raises(ExportError, match="missing"):
        export_safetensors(missing, tmp_path / "b", model_config=cfg.to_dict())
    wrong = dict(state, **{"layers.0.mlp.engine.route_table": state["layers.0.mlp.engine.route_table"].int()})
    with pytest.raises(ExportError, match="route buffers"):
        export_safetensors(wrong, tmp_path / "c", model_config=cfg.to_dict())
    with pytest.raises(ExportError, match="not allowed"):
        export_safetensors(state, tmp_path / "d", model_config=cfg.to_dict(), dtype="float64")
    with pytest.raises(ExportError, match="unknown export stage"):
        export_safetensors(state, tmp_path / "e", model_config=cfg.to_dict(), stage="sft")
    stale = dict(state, **{"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(cfg.head_dim // 2)})
    with pytest.raises(ExportError, match="does not match head_dim"):
        export_safetensors(stale, tmp_path / "f", model_config=cfg.to_dict())
    with pytest.raises(ExportError, match="chat_template must be Jinja text"):
        export_safetensors(state, tmp_path / "g", model_config=cfg.to_dict(), chat_template={"id": "x"})
    assert list(tmp_path.iterdir()) == []


def test_existing_out_dir_is_refused_but_an_empty_one_is_used(tmp_path, tiny):
    cfg, state = tiny
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_safetensors(state, busy, model_config=cfg.to_dict())
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_safetensors(state, empty, model_config=cfg.to_dict())
    assert (empty / "export_manifest.json").is_file()


def test_weights_only_init_from_export_equals_source(tmp_path, tiny):
    cfg, state = tiny
    out = tmp_path / "export"
    export_safetensors(state, out, model_config=cfg.to_dict(), stage="refinement")
    weights, record = load_weights_only(out)
    assert record.stage.value == "refinement" and record.lora is False
    model = TRHashForCausalLM(TRHashConfig.from_saved(json.loads((out / "config.json").read_text())))
    assert model.load_checkpoint_state(weights) == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_export_checkpoint_with_tokenizer_and_stage(tmp_path, tiny):
    cfg, state = tiny
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "test"}')
    ckpt = write_checkpoint(tmp_path / "run", cfg, state, tokenizer_dir=str(tok))
    manifest = export_checkpoint(ckpt, tmp_path / "export", "float32")
    out = tmp_path / "export"
    assert manifest["stage"] == "supervised-finetuning"
    assert manifest["tokenizer"] == sha256_file(tok / "tokenizer.json")
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE_JINJA
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE_JINJA and tokenizer_config["eos_token"] == "</s>"
    assert tokenizer_config["model_max_length"] == cfg.max_seq_len
    assert {"special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    run = json.loads((out / "run.json").read_text())
    assert run["source_step"] == 7 and run["lora"] is False and run["source_manifest_sha256"]
    loaded = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_lora_checkpoint_is_exported_merged(tmp_path, tiny):
    cfg, state = tiny
    torch.manual_seed(1)
    a, b = torch.randn(4, cfg.hidden_size), torch.randn(cfg.num_heads * cfg.head_dim, 4)
    adapters = {"layers.0.self_attn.q_proj.lora_A": a, "layers.0.self_attn.q_proj.lora_B": b}
    ckpt = write_checkpoint(tmp_path / "run", cfg, {**state, **adapters}, lora=True, critical={"lora.alpha": 8})
    export_checkpoint(ckpt, tmp_path / "merged")
    loaded = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert set(loaded) == set(state) | rotary_keys(cfg)
    key = "layers.0.self_attn.q_proj.weight"
    assert torch.allclose(loaded[key], state[key] + (8 / 4) * (b @ a), atol=1e-5)
    assert not torch.equal(loaded[key], state[key])
    assert json.loads((tmp_path / "merged" / "run.json").read_text())["source_lora"] is True


def test_lora_checkpoint_refused_when_it_cannot_be_merged(tmp_path, tiny):
    cfg, state = tiny
    adapters = {"layers.0.self_attn.q_proj.lora_A": torch.zeros(2, cfg.hidden_size),
                "layers.0.self_attn.q_proj.lora_B": torch.zeros(cfg.num_heads * cfg.head_dim, 2)}
    no_alpha = write_checkpoint(tmp_path / "a", cfg, {**state, **adapters}, lora=True)
    with pytest.raises(ExportError, match="no lora.alpha"):
        export_checkpoint(no_alpha, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ExportError, match="LoRA adapter tensors"):
        export_safetensors({**state, **adapters}, tmp_path / "x", model_config=cfg.to_dict())


def test_cli_export(tmp_path, tiny, capsys):
    cfg, state = tiny
    ckpt = write_checkpoint(tmp_path / "run", cfg, state, stage="refinement")
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--dtype", "float16"]) == 0
    assert json.loads((tmp_path / "e" / "export_manifest.json").read_text())["weights"]["dtype"] == "float16"
    capsys.readouterr()
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err and err.count("\n") == 1


def test_export_refuses_a_tokenizer_other_than_the_runs_unless_forced(tmp_path, tiny, capsys):
    from tests.fail_closed import tree_digest

    cfg, state = tiny
    tok, other = tmp_path / "tok", tmp_path / "other"
    for d, text in ((tok, '{"model": "trained"}'), (other, '{"model": "another"}')):
        d.mkdir()
        (d / "tokenizer.json").write_text(text)
    recorded = sha256_file(tok / "tokenizer.json")
    ckpt = write_checkpoint(tmp_path / "run", cfg, state, tokenizer_dir=str(tok), tokenizer_sha256=recorded)
    before = tree_digest(tmp_path)
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"was trained with tokenizer {recorded[:12]}" in err and "--force-tokenizer" in err
    (tok / "tokenizer.json").write_text('{"model": "edited in place"}')  # the recorded one changed
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e")]) == 2
    assert "the file changed since training" in capsys.readouterr().err
    (tok / "tokenizer.json").write_text('{"model": "trained"}')
    assert tree_digest(tmp_path) == before
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "e"), "--tokenizer", str(other),
                "--force-tokenizer"]) == 0
    run = json.loads((tmp_path / "e" / "run.json").read_text())
    assert run["tokenizer_forced"]["recorded_sha256"] == recorded
    assert run["tokenizer_forced"]["copied_sha256"] == sha256_file(other / "tokenizer.json")
