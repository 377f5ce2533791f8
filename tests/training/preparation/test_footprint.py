"""The footprint preflight and the launch size memory and disk with: counted on the meta device,
equal to the real model's counts."""
import torch

from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.lora import apply_lora
from ds_trhash.training import config as tcfg
from ds_trhash.training.preparation.footprint import count_parameters, estimate, meta_model


PRETRAIN, LORA = "ds_configs/tiny/pretrain.yaml", "ds_configs/tiny/sft_lora.yaml"


def _cfg(*overrides, path=PRETRAIN):
    return tcfg.load_config(path, list(overrides))


def _real(cfg):
    torch.manual_seed(0)
    model = TRHashForCausalLM(tcfg.model_config(cfg))
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    return model


def test_meta_counts_equal_the_real_model():
    for cfg in (_cfg(), _cfg(path=LORA)):
        counted = count_parameters(cfg.parallel, meta_model(cfg, tcfg.model_config(cfg)))
        real = _real(cfg)
        assert counted.total == sum(p.numel() for p in real.parameters())
        assert counted.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad)
        assert counted.buffer_bytes == sum(b.numel() * b.element_size() for b in real.buffers())
    lora_cfg = _cfg(path=LORA)
    lora = count_parameters(lora_cfg.parallel, meta_model(lora_cfg, tcfg.model_config(lora_cfg)))
    assert 0 < lora.trainable < lora.total / 5  # adapters only


def test_expert_parallel_and_checkpointing_shrink_a_rank():
    base = _cfg("zero.stage=1")
    ep = _cfg("zero.stage=1", "parallel.ep_size=2")
    mc = tcfg.model_config(base)
    experts = 3 * mc.num_layers * mc.num_experts * mc.hidden_size * mc.expert_width  # gate, up, down
    one, two = estimate(base, mc, 2, "cpu"), estimate(ep, mc, 2, "cpu")
    assert one.params.per_rank - two.params.per_rank == experts // 2
    assert one.checkpoint == two.checkpoint  # the checkpoint holds every expert either way
    full = estimate(_cfg("model.activation_checkpointing=full"), mc, 1, "cpu")
    assert full.activations < estimate(_cfg(), mc, 1, "cpu").activations
