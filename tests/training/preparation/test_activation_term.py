"""The estimate's activation term against what autograd really keeps after one forward: the
unique storages the saved-tensor hooks see (parameters aside), what custom autograd functions
keep on their ``ctx`` outside the hooks (Liger's loss keeps its gradients there), and the input
a checkpointed layer keeps for its recompute. On CPU, with and without activation checkpointing:
the 200m widths (two layers, a short sequence) on the PyTorch kernels, and the tiny widths (two
layers) with the Triton experts and Liger's loss and RoPE in the interpreter (Liger's norm runs
on CUDA only, so the norms stay PyTorch's: the estimate is asked for exactly those parts).
Within 10 %."""
import os

import pytest
import torch

from ds_trhash.model import TRHashForCausalLM
from ds_trhash.model.config import TRHashConfig
from ds_trhash.training import config as tcfg
from ds_trhash.training.preparation.footprint import FusedParts, _shapes_only, activation_bytes


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _ctx_tensors(loss: torch.Tensor):
    """Tensors custom autograd functions hold as attributes of their ctx (the graph's Python nodes)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for value in getattr(node, "__dict__", {}).values():
            yield from (t for t in (value if isinstance(value, (list, tuple)) else [value])
                        if isinstance(t, torch.Tensor))
        stack.extend(n for n, _ in node.next_functions)


def kept_bytes(model: TRHashForCausalLM, ids: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr, size = _storage(t)
        if ptr not in params and size:
            kept[ptr] = size
        return t

    def keep_input(_module, args) -> None:  # what a checkpointed layer keeps for its recompute
        keep(args[0])

    hooks = [layer.register_forward_pre_hook(keep_input) for layer in model.layers if layer.checkpointed]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(ids, labels=ids, reduction="sum")
    for t in _ctx_tensors(loss):
        keep(t)
    for h in hooks:
        h.remove()
    return sum(kept.values())


def _model(mc: TRHashConfig, checkpointing: bool) -> TRHashForCausalLM:
    with _shapes_only():  # no random init: the sizes are what is measured
        model = TRHashForCausalLM(mc)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.ndim > 1 else torch.nn.init.ones_(p)
    model.set_activation_checkpointing("full" if checkpointing else "none")
    return model


def _check(mc: TRHashConfig, model: TRHashForCausalLM, tokens: int, checkpointing: bool) -> None:
    cfg = tcfg.load_config("ds_configs/tiny/pretrain.yaml", overrides=[
        f"data.seq_len={tokens}", "batch.micro_batch=1", "batch.global_tokens=null", "precision=fp32"])
    ids = torch.randint(0, mc.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    measured = kept_bytes(model, ids)
    estimated = activation_bytes(cfg, mc, mc.num_layers if checkpointing else 0, "cpu", transient=False,
                                 fused=FusedParts.of(model.backends_used()))  # what the forward ran
    print(f"estimated {estimated:,} kept {measured:,} ({estimated / measured - 1:+.1%})")
    assert estimated == pytest.approx(measured, rel=0.10), (estimated, measured)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_200m_widths_on_the_pytorch_kernels(checkpointing):
    mc = TRHashConfig.from_preset("200m", num_layers=2)
    _check(mc, _model(mc, checkpointing), 32, checkpointing)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton and Liger need CUDA or the Triton interpreter")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_tiny_shape_on_triton_experts_and_liger(checkpointing):
    mc = TRHashConfig.from_preset("tiny", num_layers=2)  # per layer: two show the sum, as for 200m
    model = _model(mc, checkpointing)
    model.set_backends(experts="triton", loss="liger", rope="liger")
    _check(mc, model, 16, checkpointing)
    assert model.backends_used() == {"experts": "triton", "loss": "liger", "norm": "pytorch", "rope": "liger"}
