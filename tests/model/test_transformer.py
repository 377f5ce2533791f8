import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ds_trhash.model import RouteTableError, TRHashConfig, TRHashForCausalLM, report_route_differences
from ds_trhash.model.routing import build_route_table

TINY = TRHashConfig.from_preset("tiny", num_layers=2)


def make_model(config=TINY, seed=0):
    torch.manual_seed(seed)
    return TRHashForCausalLM(config)


def random_ids(b, t, v, seed=1):
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def test_state_dict_names_and_shapes_are_the_released_ones():
    cfg = TINY
    sd = make_model().state_dict()
    h, e, w, v = cfg.hidden_size, cfg.num_experts, cfg.expert_width, cfg.vocab_size
    expected = {"embed_tokens.weight": (v, h), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        expected |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * cfg.head_dim, h),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * cfg.head_dim, h),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * cfg.head_dim, h),
            p + "self_attn.o_proj.weight": (h, cfg.num_heads * cfg.head_dim),
            p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "mlp.engine.expert_gate": (e, h, w), p + "mlp.engine.expert_up": (e, h, w),
            p + "mlp.engine.expert_down": (e, w, h),
            p + "mlp.engine.shared_gate.weight": (cfg.shared_width, h),
            p + "mlp.engine.shared_up.weight": (cfg.shared_width, h),
            p + "mlp.engine.shared_down.weight": (h, cfg.shared_width),
            p + "mlp.engine.route_table": (2, v), p + "mlp.engine.fused_route_codes": (v,),
            p + "mlp.engine.fused_expert_pairs": (6, 2),
        }
    assert {k: tuple(t.shape) for k, t in sd.items()} == expected
    assert sd["layers.1.mlp.engine.route_table"].dtype == torch.int64
    assert sd["layers.1.mlp.engine.fused_route_codes"].dtype == torch.uint8
    assert sd["layers.1.mlp.engine.fused_expert_pairs"].dtype == torch.int32
    assert torch.equal(sd["layers.1.mlp.engine.route_table"], build_route_table(v, e, 1, cfg.route_seed))


def test_init_follows_the_spec():
    cfg = TRHashConfig.from_preset("tiny", shared_width=1024)
    model = make_model(cfg)
    residual = 0.02 / math.sqrt(2 * cfg.num_layers)
    engine, attn = model.layers[0].mlp.engine, model.layers[0].self_attn
    for t in (model.embed_tokens.weight, attn.q_proj.weight, engine.shared_gate.weight, engine.expert_up):
        assert t.std().item() == pytest.approx(0.02, rel=0.05)
    for t in (attn.o_proj.weight, engine.shared_down.weight, engine.expert_down):
        assert t.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))
    assert torch.equal(attn.k_norm.weight, torch.ones(cfg.head_dim))


def test_meta_build_then_materialise_gives_a_usable_model():
    with torch.device("meta"):
        model = TRHashForCausalLM(TINY)
    assert model.layers[0].mlp.engine.route_table.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    model.init_routes()
    model.validate_routes()
    assert report_route_differences(model) == []
    loss = model(random_ids(1, 8, TINY.vocab_size), labels=random_ids(1, 8, TINY.vocab_size, seed=2))
    assert torch.isfinite(loss)


def test_loss_at_init_is_close_to_uniform_and_backward_reaches_every_parameter():
    model = make_model(TRHashConfig.from_preset("tiny"))
    v = model.config.vocab_size
    loss = model(random_ids(2, 32, v), labels=random_ids(2, 32, v, seed=2))
    assert loss.item() == pytest.approx(math.log(v), abs=0.15)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_labels_are_used_as_given_without_shifting():
    model = make_model()
    v = TINY.vocab_size
    ids, labels = random_ids(2, 12, v), random_ids(2, 12, v, seed=3)
    labels[0, :4] = -100
    logits = model(ids)
    assert logits.shape == (2, 12, v)
    expected = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(model(ids, labels=labels), expected)
    torch.testing.assert_close(model(ids, labels=labels, reduction="sum"), expected * 20)


def test_loss_backends_agree_and_are_recorded():
    model = make_model()
    v = TINY.vocab_size
    ids, labels = random_ids(2, 12, v), random_ids(2, 12, v, seed=3)
    chunked = model(ids, labels=labels)
    assert model.backends_used() == {"experts": "pytorch", "loss": "chunked", "norm": "pytorch", "rope": "pytorch"}
    model.set_backends(loss="plain")
    torch.testing.assert_close(model(ids, labels=labels), chunked)
    assert model.backends_used()["loss"] == "plain"
    model(ids)
    assert model.backends_used()["loss"] is None  # no labels: no loss ran
    with pytest.raises(ValueError, match="unknown norm backend 'apex'"):
        model.set_backends(norm="apex")


def test_triton_expert_backend_dispatches_to_the_kernel_module(monkeypatch):
    import ds_trhash.kernels.routed_experts as kernels

    calls = []

    def fake_kernel(x, routes, gate, up, down, weights):
        calls.append(routes.shape)
        return torch.zeros_like(x)

    monkeypatch.setattr(kernels, "routed_experts_triton", fake_kernel)
    model = make_model()
    model.set_backends(experts="triton")
    model(random_ids(1, 5, TINY.vocab_size))
    assert calls == [(5, 2)] * TINY.num_layers
    assert model.backends_used()["experts"] == "triton"


def test_hidden_states_are_the_final_normed_activations():
    model = make_model()
    ids = random_ids(1, 6, TINY.vocab_size)
    seen = []
    model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    h = model.hidden_states(ids)
    assert h.shape == (1, 6, TINY.hidden_size)
    x = seen[0]  # the residual stream entering the final norm (weight is one at init)
    torch.testing.assert_close(h, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(h @ model.embed_tokens.weight.t(), model(ids))


def test_documents_in_a_packed_row_do_not_see_each_other():
    model = make_model()
    v = TINY.vocab_size
    doc_a, doc_b = random_ids(1, 7, v, seed=4), random_ids(1, 9, v, seed=5)
    other_a = random_ids(1, 7, v, seed=6)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    pos = torch.cat((torch.arange(7), torch.arange(9)))[None]
    packed = model(torch.cat((doc_a, doc_b), 1), position_ids=pos, document_ids=doc_ids)
    changed = model(torch.cat((other_a, doc_b), 1), position_ids=pos, document_ids=doc_ids)
    torch.testing.assert_close(changed[:, 7:], packed[:, 7:])
    torch.testing.assert_close(packed[:, 7:], model(doc_b), rtol=1e-5, atol=1e-5)  # as if alone
    leaky = model(torch.cat((other_a, doc_b), 1), position_ids=pos)  # no document ids: causal only
    assert not torch.allclose(leaky[:, 7:], packed[:, 7:], atol=1e-4)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_routes_persist_through_save_and_load(tmp_path, fmt):
    saved = make_model(seed=0)
    sd = saved.state_dict()
    path = tmp_path / "model.bin"
    if fmt == "torch":
        torch.save(sd, path)
        loaded_sd = torch.load(path)
    else:
        save_file(sd, str(path))
        loaded_sd = load_file(str(path))
    fresh = make_model(seed=1)
    assert fresh.load_checkpoint_state(loaded_sd) == []
    for key, value in sd.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_checkpoint_routes_win_over_the_config_and_the_difference_is_reported():
    checkpoint = make_model().state_dict()
    other_cfg = dataclasses.replace(TINY, route_seed=12345)
    model = make_model(other_cfg)
    assert not torch.equal(model.layers[0].mlp.engine.route_table, checkpoint["layers.0.mlp.engine.route_table"])
    assert len(report_route_differences(model, checkpoint)) == TINY.num_layers
    report = model.load_checkpoint_state(checkpoint)
    for i in range(TINY.num_layers):
        engine = model.layers[i].mlp.engine
        assert torch.equal(engine.route_table, checkpoint[f"layers.{i}.mlp.engine.route_table"])
        assert torch.equal(engine.fused_route_codes, checkpoint[f"layers.{i}.mlp.engine.fused_route_codes"])
    assert len(report) == TINY.num_layers
    assert report[1].startswith("layer 1: ") and "route_seed=0x3039" in report[1]
    ids = random_ids(1, 6, TINY.vocab_size)
    original = make_model()
    original.load_state_dict(checkpoint)
    torch.testing.assert_close(model(ids), original(ids))  # routing really came from the checkpoint


def test_stale_rotary_cache_key_is_tolerated():
    sd = make_model().state_dict()
    sd["layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(TINY.head_dim // 2)
    assert make_model(seed=2).load_checkpoint_state(sd) == []


def corrupt_coinciding(sd):
    table = sd["layers.1.mlp.engine.route_table"].clone()
    table[1, 11] = table[0, 11]
    sd["layers.1.mlp.engine.route_table"] = table


def corrupt_shape(sd):
    sd["layers.0.mlp.engine.route_table"] = sd["layers.0.mlp.engine.route_table"][:, :-1]


def corrupt_codes(sd):
    codes = sd["layers.1.mlp.engine.fused_route_codes"].clone()
    codes[3] ^= 8
    sd["layers.1.mlp.engine.fused_route_codes"] = codes


@pytest.mark.parametrize("corrupt,message", [
    (corrupt_coinciding, r"layer 1: .*first offending token ids: \[11\]"),
    (corrupt_shape, r"layer 0: .*shape"),
    (corrupt_codes, r"layer 1: fused_route_codes disagree with route_table for tokens \[3\]"),
])
def test_bad_route_tables_are_refused_before_anything_loads(corrupt, message):
    sd = make_model(seed=0).state_dict()
    corrupt(sd)
    model = make_model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RouteTableError, match=message):
        model.load_checkpoint_state(sd)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_validate_routes_catches_corrupted_buffers():
    model = make_model()
    with torch.no_grad():
        model.layers[1].mlp.engine.route_table[1, 0] = model.layers[1].mlp.engine.route_table[0, 0]
    with pytest.raises(RouteTableError, match="layer 1"):
        model.validate_routes()


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Liger needs CUDA or the Triton interpreter")
def test_liger_rope_and_loss_match_pytorch():
    model = make_model()
    ids, labels = random_ids(1, 9, TINY.vocab_size), random_ids(1, 9, TINY.vocab_size, seed=3)
    pos = torch.arange(9)[None] + 4
    reference = model(ids, labels=labels, position_ids=pos)
    ref_grad = torch.autograd.grad(reference, model.layers[0].self_attn.q_proj.weight)[0]
    model.set_backends(rope="liger", loss="liger")
    fused = model(ids, labels=labels, position_ids=pos)
    grad = torch.autograd.grad(fused, model.layers[0].self_attn.q_proj.weight)[0]
    assert model.backends_used() == {"experts": "pytorch", "loss": "liger", "norm": "pytorch", "rope": "liger"}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.gpu
def test_liger_norm_matches_pytorch_on_gpu():
    model = make_model().cuda()
    ids = random_ids(2, 16, TINY.vocab_size).cuda()
    labels = random_ids(2, 16, TINY.vocab_size, seed=3).cuda()
    reference = model(ids, labels=labels)
    model.set_backends(norm="liger", loss="liger")
    fused = model(ids, labels=labels)
    assert model.backends_used() == {"experts": "pytorch", "loss": "liger", "norm": "liger", "rope": "pytorch"}
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)


def test_bf16_model_trains_close_to_fp32():
    model = make_model()
    ids, labels = random_ids(2, 16, TINY.vocab_size), random_ids(2, 16, TINY.vocab_size, seed=3)
    reference = model(ids, labels=labels)
    model.to(torch.bfloat16)
    assert model.layers[0].mlp.engine.route_table.dtype == torch.int64  # buffers keep their dtype
    loss = model(ids, labels=labels)
    loss.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(reference.item(), abs=0.05)
    assert all(p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all() for p in model.parameters())
