"""The MoE block of a decoder layer (ds_trhash/model/decoder.py): the engine adds the shared
expert and the routed experts with their scales, on clamped token ids."""
import torch
import torch.nn.functional as F

from ds_trhash.model import TRHashConfig
from ds_trhash.model.decoder import TRHashMoEEngine

from .reference import masked_reference


def test_moe_engine_combines_shared_and_routed_with_clamped_token_ids():
    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset("tiny", route_weights=(0.6, 0.4), shared_scale=1.5)
    engine = TRHashMoEEngine(cfg, layer=1)
    x = torch.randn(6, cfg.hidden_size)
    ids = torch.tensor([0, 5, cfg.vocab_size - 1, cfg.vocab_size + 9, -4, 77])
    clamped = ids.clamp(0, cfg.vocab_size - 1)
    routes = engine.route_table[:, clamped].t()
    shared = engine.shared_down(F.silu(engine.shared_gate(x)) * engine.shared_up(x))
    routed = masked_reference(x, routes, engine.expert_gate, engine.expert_up, engine.expert_down, (0.6, 0.4))
    torch.testing.assert_close(engine(x, ids), 1.5 * shared + 2.0 * routed)
    assert engine.last_backend == "pytorch"
