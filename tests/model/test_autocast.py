"""The model under torch.autocast(bf16) matches the pure-bf16 model (fp32 weights vs bf16 weights)."""
import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM

CFG = TRHashConfig.from_preset("tiny", num_layers=2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def test_autocast_matches_the_pure_bf16_model_in_loss_and_gradients():
    torch.manual_seed(0)
    mixed = TRHashForCausalLM(CFG)  # fp32 weights, bf16 compute by autocast
    pure = TRHashForCausalLM(CFG)
    pure.load_state_dict(mixed.state_dict())
    pure.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (2, 24), generator=gen)
    batch = {"labels": ids.roll(-1, 1), "document_ids": torch.tensor([[0] * 10 + [1] * 14] * 2)}

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_mixed = mixed(ids, **batch)
    loss_mixed.backward()
    loss_pure = pure(ids, **batch)
    loss_pure.backward()

    assert loss_mixed.dtype == torch.float32
    assert abs(loss_mixed.item() - loss_pure.item()) < 2e-2 * loss_pure.item()
    pure_params = dict(pure.named_parameters())
    for name, p in mixed.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert rel(p.grad, pure_params[name].grad) < 0.1, name
