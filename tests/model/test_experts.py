import pytest
import torch
import torch.nn.functional as F

from ds_trhash.model.experts import routed_experts

from .reference import masked_reference


def make_case(n=97, h=24, w=8, e=4, idle_expert=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.tensor([i for i in range(e) if i != idle_expert])
    picks = torch.stack([torch.randperm(len(experts), generator=gen)[:2] for _ in range(n)])
    routes = experts[picks].to(torch.int64)  # two distinct experts per token
    x = torch.randn(n, h, generator=gen)
    gate = torch.randn(e, h, w, generator=gen) / h ** 0.5
    up = torch.randn(e, h, w, generator=gen) / h ** 0.5
    down = torch.randn(e, w, h, generator=gen) / w ** 0.5
    return routes, [t.requires_grad_() for t in (x, gate, up, down)]


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def forward_and_grads(fn, routes, tensors, weights, probe):
    out = fn(tensors[0], routes, *tensors[1:], weights)
    grads = torch.autograd.grad((out * probe).sum(), tensors)
    return out, grads


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.7, 0.3)])
@pytest.mark.parametrize("idle_expert", [None, 2])
def test_gathered_path_matches_masked_reference(weights, idle_expert):
    routes, tensors = make_case(idle_expert=idle_expert)
    probe = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(1))
    out, grads = forward_and_grads(routed_experts, routes, tensors, weights, probe)
    ref, ref_grads = forward_and_grads(masked_reference, routes, tensors, weights, probe)
    assert rel_err(out, ref) <= 1e-6
    for name, g, r in zip(("x", "gate", "up", "down"), grads, ref_grads):
        assert rel_err(g, r) <= 1e-6, name
    if idle_expert is not None:
        for g in grads[1:]:
            assert torch.count_nonzero(g[idle_expert]) == 0


def test_primary_and_secondary_weights_are_not_swapped():
    routes, (x, gate, up, down) = make_case(n=5)
    out = routed_experts(x, routes, gate, up, down, (1.0, 0.0))
    ref = torch.stack([(F.silu(x[i] @ gate[r]) * (x[i] @ up[r])) @ down[r] for i, r in enumerate(routes[:, 0])])
    torch.testing.assert_close(out, ref)


def test_unknown_backend_is_rejected():
    routes, (x, gate, up, down) = make_case(n=3)
    with pytest.raises(ValueError, match="unknown experts backend 'cuda'"):
        routed_experts(x, routes, gate, up, down, backend="cuda")


def test_pytorch_path_runs_under_autocast():
    """A user's bf16 autocast loop: the expert matmuls come out bf16, the buffer stays fp32."""
    import torch

    from ds_trhash.model.experts import routed_experts

    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    gate, up, down = torch.randn(4, 8, 4), torch.randn(4, 8, 4), torch.randn(4, 4, 8)
    routes = torch.tensor([[i % 4, (i + 1) % 4] for i in range(10)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = routed_experts(x, routes, gate, up, down)
    ref = routed_experts(x, routes, gate, up, down)
    assert y.dtype == torch.float32
    assert float((y - ref).norm() / ref.norm()) < 2e-2  # bf16 matmuls, fp32 accumulation buffer
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.7, 0.3)])
def test_masked_backend_matches_the_masked_reference(weights):
    """The dense masked backend (every expert on every token, weighted by the route mask) that
    the per-shape probe may pick over the Triton kernel."""
    routes, tensors = make_case(idle_expert=1)
    probe = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(1))
    out, grads = forward_and_grads(lambda *a: routed_experts(*a, backend="masked"), routes, tensors, weights, probe)
    ref, ref_grads = forward_and_grads(masked_reference, routes, tensors, weights, probe)
    assert rel_err(out, ref) <= 1e-6
    for name, g, r in zip(("x", "gate", "up", "down"), grads, ref_grads):
        assert rel_err(g, r) <= 1e-6, name
    assert all(torch.count_nonzero(g[1]) == 0 for g in grads[1:])  # the idle expert's weights
