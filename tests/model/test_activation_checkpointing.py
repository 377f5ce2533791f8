"""Activation checkpointing recomputes decoder layers in backward and changes no gradient."""
import copy

import pytest
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.model.lora import LoraSection, apply_lora

CFG = TRHashConfig.from_preset("tiny")  # 4 decoder layers


def _grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # LoRA dropout draws: checkpointing must replay the same ones
    model(ids, labels=labels, reduction="sum").backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_gradients_equal_those_without_checkpointing(lora):
    torch.manual_seed(0)
    base = TRHashForCausalLM(CFG)
    if lora:  # dropout > 0 in train mode: the recomputed forward must see the same masks
        apply_lora(base, LoraSection(enabled=True, rank=4, alpha=8.0, dropout=0.3,
                                     targets=("q_proj", "v_proj", "shared_up"), experts=False))
        for n, p in base.named_parameters():  # non-zero B so the adapters shape the gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
    base.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 64), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (2, 64), generator=g)
    reference = _grads(base, ids, labels)
    assert base.set_activation_checkpointing("none") == []
    for mode, every, layers in (("full", 2, [0, 1, 2, 3]), ("every_n", 2, [0, 2]), ("every_n", 3, [0, 3])):
        model = copy.deepcopy(base)
        assert model.set_activation_checkpointing(mode, every) == layers
        got = _grads(model, ids, labels)
        assert got.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(got[name], reference[name], rtol=1e-5, atol=1e-6, msg=f"{mode} {name}")


def test_checkpointing_frees_layer_activations_in_forward():
    """Fewer tensors are saved for backward: the evidence that layers are really recomputed."""
    torch.manual_seed(0)
    model = TRHashForCausalLM(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 64))

    def saved_bytes():
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids, reduction="sum")
        return total

    plain = saved_bytes()
    model.set_activation_checkpointing("full")
    assert saved_bytes() < plain / 2


def test_unknown_mode_is_refused():
    model = TRHashForCausalLM(CFG)
    with pytest.raises(ValueError, match="allowed: \\['none', 'full', 'every_n'\\]"):
        model.set_activation_checkpointing("some")
    with pytest.raises(ValueError, match="n >= 1"):
        model.set_activation_checkpointing("every_n", 0)
