"""Triton routed experts vs a dense reference: forward and gradients (docs/contracts.md §1, §7).

On CPU these run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported) in fp32 at small shapes; the bf16 variants need CUDA (marked gpu).
"""
import os

import pytest
import torch
import torch.nn.functional as F

from ds_trhash.kernels import routed_experts as rk
from ds_trhash.model import experts as model_experts
from ds_trhash.kernels.routed_experts import routed_experts_triton

ON_CUDA = torch.cuda.is_available()
CAN_RUN = ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not CAN_RUN, reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if ON_CUDA else "cpu"


def dense_reference(x, routes, gate, up, down, weights):
    """Every expert on every token, masked by the routes: independent of any sorting."""
    y = torch.zeros_like(x, dtype=torch.float32)
    xf = x.float()
    for e in range(gate.shape[0]):
        out = (F.silu(xf @ gate[e].float()) * (xf @ up[e].float())) @ down[e].float()
        for k, w in enumerate(weights):
            y = y + w * (routes[:, k] == e).unsqueeze(1).float() * out
    return y.to(x.dtype)


def make_case(N, H, W, E, dtype=torch.float32, device=DEVICE, empty_expert=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    experts = [e for e in range(E) if e != empty_expert]
    # two distinct experts per token, as the route builder guarantees
    idx = torch.stack([torch.randperm(len(experts), generator=gen)[:2] for _ in range(N)])
    routes = torch.tensor(experts)[idx].to(torch.int64)
    x = torch.randn(N, H, generator=gen)
    gate = torch.randn(E, H, W, generator=gen) / H ** 0.5
    up = torch.randn(E, H, W, generator=gen) / H ** 0.5
    down = torch.randn(E, W, H, generator=gen) / W ** 0.5
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, gate, up, down)]
    return leaves[0], routes.to(device), leaves[1], leaves[2], leaves[3]


def check_against_reference(N, H, W, E, weights, dtype, rtol, empty_expert=None):
    x, routes, gate, up, down = make_case(N, H, W, E, dtype=dtype, empty_expert=empty_expert)
    y = routed_experts_triton(x, routes, gate, up, down, weights)
    assert y.shape == (N, H) and y.dtype == dtype
    dy = torch.randn(N, H, device=x.device, dtype=dtype)
    grads = torch.autograd.grad(y, (x, gate, up, down), dy)

    # reference in fp32 from the same (possibly bf16-rounded) inputs
    ref_in = [t.detach().float().requires_grad_() for t in (x, gate, up, down)]
    y_ref = dense_reference(ref_in[0], routes, ref_in[1], ref_in[2], ref_in[3], weights)
    ref_grads = torch.autograd.grad(y_ref, ref_in, dy.float())

    def close(name, got, want):
        err = (got.float() - want).abs().max().item()
        scale = want.abs().max().item() + 1e-6
        assert err <= rtol * scale, f"{name}: max abs err {err:.3e} vs scale {scale:.3e}"

    close("y", y, y_ref)
    for name, got, want in zip(("dx", "dgate", "dup", "ddown"), grads, ref_grads):
        close(name, got, want)
    if empty_expert is not None:
        assert grads[1][empty_expert].abs().max() == 0
        assert grads[2][empty_expert].abs().max() == 0
        assert grads[3][empty_expert].abs().max() == 0


SHAPES = [
    # N, H, W, E, empty expert: N and H not multiples of the interpreter's 16-wide blocks
    pytest.param(37, 24, 12, 4, 2, id="ragged-empty-expert"),
    pytest.param(1, 20, 16, 4, None, id="single-token"),
    pytest.param(64, 32, 16, 3, None, id="full-blocks"),
]


@pytest.mark.parametrize("N,H,W,E,empty", SHAPES)
def test_fp32_matches_dense_reference(N, H, W, E, empty):
    check_against_reference(N, H, W, E, (0.5, 0.5), torch.float32, rtol=1e-4, empty_expert=empty)


def test_unequal_route_weights():
    check_against_reference(29, 20, 8, 4, (0.7, 0.3), torch.float32, rtol=1e-4)


def test_matches_pytorch_backend_of_model():
    """Same contract as ds_trhash.model.experts.routed_experts(backend="pytorch")."""
    x, routes, gate, up, down = make_case(23, 16, 8, 4, seed=3)
    y = routed_experts_triton(x, routes, gate, up, down, (0.5, 0.5))
    y_ref = model_experts.routed_experts(x, routes, gate, up, down, (0.5, 0.5), backend="pytorch")
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (x, gate, up, down), dy),
                    torch.autograd.grad(y_ref, (x, gate, up, down), dy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_split_k_weight_gradients_match_single_split():
    """The split-K partial sums (used at large N on GPU) give the unsplit result."""
    x, routes, gate, _, _ = make_case(40, 16, 8, 3, seed=1)
    x = x.detach()
    order, offsets = rk._sort_assignments(routes, 3)
    b = torch.randn(order.numel(), 8, device=x.device)
    tok = (order.long() // 2)
    want = torch.stack([x[tok[s:t]].T @ b[s:t] for s, t in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    for splits in (1, 3):
        (whole,) = rk._launch_grouped_dw(x, b, order, offsets, out_dtype=torch.float32, a_indirect=True,
                                      b_indirect=False, splits=splits)
        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
        # the column halves straight into two gradients (d_gate, d_up), one split or partials summed
        left, right = rk._launch_grouped_dw(x, b, order, offsets, out_dtype=torch.float32, a_indirect=True,
                                            b_indirect=False, half=4, splits=splits)
        torch.testing.assert_close(left, want[..., :4], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(right, want[..., 4:], rtol=1e-5, atol=1e-5)


def test_sort_and_offsets():
    routes = torch.tensor([[0, 2], [2, 0], [1, 2], [2, 1]], device=DEVICE)
    order, offsets = rk._sort_assignments(routes, 4)
    assert offsets.tolist() == [0, 2, 4, 8, 8]  # expert 3 receives no tokens
    assert order.tolist() == [0, 3, 4, 7, 1, 2, 5, 6]  # stable within an expert


def test_deterministic_and_no_tokens():
    x, routes, gate, up, down = make_case(19, 16, 8, 4, seed=2)
    y1 = routed_experts_triton(x, routes, gate, up, down)
    y2 = routed_experts_triton(x, routes, gate, up, down)
    assert torch.equal(y1, y2)
    empty = routed_experts_triton(x[:0], routes[:0], gate, up, down)
    assert empty.shape == (0, 16)
    empty.sum().backward()
    assert gate.grad is not None and gate.grad.abs().max() == 0


def test_rejects_bad_inputs():
    x, routes, gate, up, down = make_case(4, 16, 8, 4)
    with pytest.raises(ValueError, match="routes must be"):
        routed_experts_triton(x, routes[:, :1], gate, up, down)
    with pytest.raises(ValueError, match="down must be"):
        routed_experts_triton(x, routes, gate, up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="one dtype"):
        routed_experts_triton(x.double(), routes, gate, up, down)
    if not ON_CUDA:
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            routed_experts_triton(x, routes.clone().fill_(4), gate, up, down)


# ------------------------------------------------------------------------------ GPU only


GPU_SHAPES = [
    pytest.param(37, 24, 12, 4, 2, id="ragged-empty-expert"),
    pytest.param(1, 896, 64, 4, None, id="single-token-200m-width"),
    pytest.param(1000, 896, 64, 4, None, id="200m-shape"),
    pytest.param(4099, 200, 48, 4, 1, id="ragged-large"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,W,E,empty", GPU_SHAPES)
def test_bf16_matches_reference_on_gpu(N, H, W, E, empty):
    # bf16 storage of h/g/u and of the gradients between kernels: ~1e-2 relative of the max.
    check_against_reference(N, H, W, E, (0.5, 0.5), torch.bfloat16, rtol=2e-2, empty_expert=empty)


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,W,E,empty", GPU_SHAPES)
def test_fp32_matches_reference_on_gpu(N, H, W, E, empty):
    check_against_reference(N, H, W, E, (0.5, 0.5), torch.float32, rtol=1e-4, empty_expert=empty)


@pytest.mark.gpu
def test_split_k_path_on_gpu_large_n():
    # 32768 tokens -> 65536 assignments -> 16 splits per expert in the weight gradients
    check_against_reference(32768, 128, 64, 4, (0.5, 0.5), torch.bfloat16, rtol=2e-2)


def test_split_k_partials_through_the_whole_op_and_a_broadcast_gradient(monkeypatch):
    """Weight gradients summed from split-K partials (fp32, fixed order) through the op, and a dy
    that is a stride-0 broadcast (y.sum()'s gradient), read through its strides."""
    monkeypatch.setattr(rk, "_default_splits", lambda M, E: 3)
    check_against_reference(37, 24, 12, 4, (0.6, 0.4), torch.float32, rtol=1e-4, empty_expert=2)
    x, routes, gate, up, down = make_case(21, 16, 8, 4, seed=4)
    y = routed_experts_triton(x, routes, gate, up, down)
    broadcast = torch.autograd.grad(y.sum(), (x, gate, up, down), retain_graph=True)
    dense = torch.autograd.grad(y, (x, gate, up, down), torch.ones_like(y))
    for a, b in zip(broadcast, dense):
        assert torch.equal(a, b)
