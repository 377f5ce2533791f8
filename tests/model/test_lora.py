"""LoRA mode: wrapping, freezing, names, merging, resume-state checks, a training step."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.lora import (
    LoRAError,
    LoRALinear,
    LoRAMoEEngine,
    apply_lora,
    check_state_mode,
    has_lora_state,
    is_lora_key,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    merge_lora_state_dict,
    trainable_parameter_count,
)
from ds_trhash.model.lora import DEFAULT_LORA_TARGETS
from ds_trhash.model.lora import LoraSection

CFG = TRHashConfig.from_preset("tiny", num_layers=2, vocab_size=512)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "shared_gate", "shared_up", "shared_down")


def lora(**kw) -> LoraSection:
    return dataclasses.replace(LoraSection(enabled=True), **kw)


def model(seed: int = 0) -> TRHashForCausalLM:
    torch.manual_seed(seed)
    return TRHashForCausalLM(CFG)


def ids(seed: int = 1, b: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def randomize_b(m: torch.nn.Module, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def expected_adapter_params(rank: int, targets, experts: bool) -> int:
    """r·(in + out) per wrapped linear; 3 stacked expert weights of E·r·(H + W) each."""
    h, q, kv, s = CFG.hidden_size, CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim, CFG.shared_width
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "shared_gate": (h, s), "shared_up": (h, s), "shared_down": (s, h)}
    per_layer = sum(rank * sum(shapes[t]) for t in targets)
    if experts:
        per_layer += 3 * CFG.num_experts * rank * (h + CFG.expert_width)
    return CFG.num_layers * per_layer


def test_spec_defaults_wrap_and_freeze():
    m = model()
    buffers = {k: v.clone() for k, v in m.named_buffers()}
    names = apply_lora(m, lora())
    assert names == [f"layers.{i}.{p}" for i in range(CFG.num_layers) for p in
                     ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.engine.shared_gate", "mlp.engine.shared_up", "mlp.engine.shared_down")]
    assert tuple(LoraSection().targets) == DEFAULT_LORA_TARGETS and LoraSection().rank == 16
    for name in names:
        mod = m.get_submodule(name)
        assert isinstance(mod, LoRALinear) and mod.scaling == 1.0
        assert not mod.lora_B.any() and mod.lora_A.abs().sum() > 0
    assert isinstance(m.layers[0].self_attn.k_proj, torch.nn.Linear)  # not a default target
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(is_lora_key(n) for n in trainable)
    assert trainable_parameter_count(m) == expected_adapter_params(16, DEFAULT_LORA_TARGETS, False)
    assert not any(isinstance(e, LoRAMoEEngine) for e in m.engines())
    for k, v in m.named_buffers():
        assert torch.equal(v, buffers[k]), k  # route buffers untouched


@pytest.mark.parametrize("experts", [False, True])
def test_zero_b_is_exactly_the_base_model(experts):
    base, wrapped = model(), model()
    names = apply_lora(wrapped, lora(targets=ALL_LINEAR, experts=experts, dropout=0.0, rank=4))
    assert len(names) == CFG.num_layers * (7 + (3 if experts else 0))
    x = ids()
    base.eval(), wrapped.eval()
    with torch.no_grad():
        assert torch.equal(base(x), wrapped(x))
    # in train mode dropout only touches the (zero) update, so still identical
    wrapped.train()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), base(x), rtol=0, atol=0)


def test_state_dict_names_preserved():
    plain_keys = list(model().state_dict())
    m = model()
    apply_lora(m, lora(experts=True))
    keys = list(m.state_dict())
    assert [k for k in keys if not is_lora_key(k)] == plain_keys
    assert "layers.0.self_attn.q_proj.weight" in keys
    assert not any(".base." in k for k in keys)
    adapters = [k for k in keys if is_lora_key(k)]
    assert "layers.0.self_attn.q_proj.lora_A" in adapters and "layers.1.mlp.engine.shared_down.lora_B" in adapters
    assert "layers.0.mlp.engine.expert_gate_lora.lora_A" in adapters
    assert len(adapters) == CFG.num_layers * 2 * (6 + 3)
    sd = m.state_dict()
    assert sd["layers.0.self_attn.q_proj.lora_A"].shape == (16, CFG.hidden_size)
    assert sd["layers.0.self_attn.q_proj.lora_B"].shape == (CFG.num_heads * CFG.head_dim, 16)
    assert sd["layers.0.mlp.engine.expert_down_lora.lora_A"].shape == (CFG.num_experts, CFG.expert_width, 16)
    # a base checkpoint loads into the wrapped model; only adapters are missing
    result = m.load_state_dict(model(5).state_dict(), strict=False)
    assert sorted(result.missing_keys) == sorted(adapters) and not result.unexpected_keys
    # the wrapped model's full state round-trips strictly into another wrapped model
    other = model(9)
    apply_lora(other, lora(experts=True))
    other.load_state_dict(sd)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in sd.items())


@pytest.mark.parametrize("rank", [0, -2])
def test_non_positive_rank_refused(rank):
    with pytest.raises(LoRAError, match="positive rank; pass --lora-rank N or use --full-parameter"):
        apply_lora(model(), lora(rank=rank))


@pytest.mark.parametrize("kw,match", [
    ({"targets": ("q_proj", "mlp")}, r"unknown LoRA target\(s\) \['mlp'\]; allowed: q_proj"),
    ({"targets": ("expert_gate",)}, "lora.experts"),
    ({"targets": ("q_proj", "q_proj")}, "duplicate"),
    ({"enabled": False}, "full-parameter"),
    ({"alpha": 0.0}, "alpha"),
    ({"dropout": 1.0}, "dropout"),
])
def test_bad_settings_refused(kw, match):
    m = model()
    with pytest.raises(LoRAError, match=match):
        apply_lora(m, lora(**kw))
    assert not has_lora_state(m.state_dict())  # nothing half-applied


def test_applying_twice_refused():
    m = model()
    apply_lora(m, lora())
    with pytest.raises(LoRAError, match="already"):
        apply_lora(m, lora())


@pytest.mark.parametrize("experts", [False, True])
def test_merge_equivalence(experts):
    m = model()
    cfg = lora(targets=ALL_LINEAR, experts=experts, rank=4, alpha=8.0)
    apply_lora(m, cfg)
    randomize_b(m)
    m.eval()
    merged = merge_lora(m)
    assert list(merged) == list(model().state_dict())
    assert not has_lora_state(merged)
    fresh = model(7)
    fresh.load_state_dict(merged)
    fresh.eval()
    x = ids()
    with torch.no_grad():
        ref, out = m(x), fresh(x)
        assert not torch.allclose(ref, model()(x), atol=1e-4)  # the adapters do matter
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # merging from the saved state dict alone gives the same tensors
    from_sd = merge_lora_state_dict(m.state_dict(), alpha=8.0)
    assert list(from_sd) == list(merged)
    for k, v in merged.items():
        torch.testing.assert_close(from_sd[k], v, rtol=0, atol=0)
    # the model was not changed by merging
    assert has_lora_state(m.state_dict())


def test_has_lora_state_and_mode_rule():
    m = model()
    plain = m.state_dict()
    assert not has_lora_state(plain)
    apply_lora(m, lora())
    assert has_lora_state(m.state_dict()) and has_lora_state(lora_state_dict(m))
    assert has_lora_state(["a.lora_B"]) and not has_lora_state(["lora_A.weight"])
    check_state_mode(plain, lora_enabled=False)
    check_state_mode(m.state_dict(), lora_enabled=True)
    with pytest.raises(LoRAError, match="full-parameter; full and LoRA runs never resume"):
        check_state_mode(m.state_dict(), lora_enabled=False, where="step_10")
    with pytest.raises(LoRAError, match="no LoRA adapter state but this run is in LoRA mode"):
        check_state_mode(plain, lora_enabled=True)


def test_lora_state_dict_round_trip():
    m = model()
    apply_lora(m, lora(experts=True))
    randomize_b(m)
    adapters = lora_state_dict(m)
    assert adapters and all(is_lora_key(k) for k in adapters)
    assert len(adapters) == len([k for k in m.state_dict() if is_lora_key(k)])
    other = model()
    apply_lora(other, lora(experts=True))
    load_lora_state_dict(other, adapters)
    assert all(torch.equal(v, lora_state_dict(other)[k]) for k, v in adapters.items())
    with pytest.raises(LoRAError, match="missing"):
        load_lora_state_dict(other, dict(list(adapters.items())[1:]))
    with pytest.raises(LoRAError, match="no LoRA adapters"):
        load_lora_state_dict(model(), adapters)


@pytest.mark.parametrize("experts", [False, True])
def test_training_step_changes_only_adapters(experts):
    m = model()
    apply_lora(m, lora(rank=4, experts=experts))
    assert trainable_parameter_count(m) == expected_adapter_params(4, DEFAULT_LORA_TARGETS, experts)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    # every parameter handed to the optimizer: frozen ones must stay put on their own
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    m.train()
    x = ids(b=2, t=12)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        m(x[:, :-1], labels=x[:, 1:]).backward()
        opt.step()
    after = m.state_dict()
    frozen_grads = [n for n, p in m.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_grads
    for k, v in after.items():
        if is_lora_key(k):
            assert not torch.equal(v, before[k]), f"adapter {k} did not train"
        else:
            assert torch.equal(v, before[k]), f"frozen {k} changed"


def test_200m_default_adapter_count_on_meta():
    """The count quoted in docs/lora.md; built on the meta device, so free."""
    with torch.device("meta"):
        m = TRHashForCausalLM(TRHashConfig.from_preset("200m"))
    apply_lora(m, lora())
    assert trainable_parameter_count(m) == 4_227_072
