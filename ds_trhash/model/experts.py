"""Routed SwiGLU experts: the PyTorch gathered path and the dispatch to fused kernels.

The gathered path is the numerical reference for the Triton kernels (docs/contracts.md §7), so
it is kept plain: each expert runs only on the tokens routed to it (half the FLOPs of computing
every expert on every token with top-2 of 4), and results are scattered back with their weight.

Both backends are ``torch.library`` custom ops (``ds_trhash::routed_experts_gathered`` here,
``ds_trhash::routed_experts_triton`` in the kernels package) with a fake implementation and a
registered backward. ``torch.compile`` therefore sees one opaque node of static output shape
[N, H] per layer: the data-dependent part (how many tokens each expert gets) lives inside the op
and never breaks the graph.

Autocast: the op is not itself autocast-aware, so ``routed_experts`` casts x and the expert
weights to the autocast dtype before calling it (what autocast does for a matmul) and casts the
result back to x's dtype (the residual stream keeps its dtype, as under autocast before).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F

from .autocast import autocast_dtype

EXPERT_BACKENDS = ("pytorch", "triton", "masked")


def _groups(routes: torch.Tensor, weights: Sequence[float], num_experts: int,
            dtype: torch.dtype) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert: (token indices, route weights) of the assignments it serves, in token order.

    The split sizes are read on the host (one ``tolist`` per call): this is the data-dependent
    part that the custom op keeps away from the compiler.
    """
    n, k = routes.shape
    flat_expert = routes.reshape(-1)  # [N*K], token-major
    flat_token = torch.arange(n, device=routes.device).repeat_interleave(k)
    flat_weight = torch.tensor(list(weights), dtype=dtype, device=routes.device).repeat(n)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=num_experts).tolist()
    return zip(flat_token[order].split(counts), flat_weight[order].split(counts))


@torch.library.custom_op("ds_trhash::routed_experts_gathered", mutates_args=())
def _gathered_forward(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      down: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """x [N, H], routes [N, K] int64, gate/up [E, H, W], down [E, W, H] -> [N, H] in x's dtype;
    weights[k] scales route k."""
    out = torch.zeros_like(x)  # filled in place: one [N, H] buffer however many experts
    for e, (idx, w) in enumerate(_groups(routes, weights, gate.shape[0], x.dtype)):
        if idx.numel() == 0:
            continue  # an idle expert costs nothing
        xe = x.index_select(0, idx)  # [n_e, H]
        g, u = (xe @ torch.cat((gate[e], up[e]), dim=1)).chunk(2, dim=1)  # one GEMM: [n_e, 2W]
        he = F.silu(g) * u * w[:, None]  # route weight applied at width W, not H
        out.index_add_(0, idx, (he @ down[e]).to(out.dtype))
    return out


@_gathered_forward.register_fake
def _(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
      weights: list[float]) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("ds_trhash::routed_experts_gathered_backward", mutates_args=())
def _gathered_backward(dy: torch.Tensor, x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor, down: torch.Tensor,
                       weights: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dgate, dup, ddown) of the gathered path; the SwiGLU pre-activations are recomputed
    (width W per routed token: cheaper than keeping them for the whole step)."""
    dy = dy.to(x.dtype)
    dx = torch.zeros_like(x)
    d_gate, d_up, d_down = torch.zeros_like(gate), torch.zeros_like(up), torch.zeros_like(down)
    for e, (idx, w) in enumerate(_groups(routes, weights, gate.shape[0], x.dtype)):
        if idx.numel() == 0:
            continue  # an idle expert's weight gradient stays zero
        xe, dye = x.index_select(0, idx), dy.index_select(0, idx)  # [n_e, H]
        g, u = (xe @ torch.cat((gate[e], up[e]), dim=1)).chunk(2, dim=1)
        sig = torch.sigmoid(g)
        silu = g * sig
        d_down[e] = (silu * u * w[:, None]).t() @ dye  # [W, H]
        d_act = (dye @ down[e].t()) * w[:, None]  # d(silu(g) * u): [n_e, W]
        d_g = d_act * u * (sig * (1 + g * (1 - sig)))
        d_u = d_act * silu
        d_gate[e] = xe.t() @ d_g
        d_up[e] = xe.t() @ d_u
        dx.index_add_(0, idx, d_g @ gate[e].t() + d_u @ up[e].t())
    return dx, d_gate, d_up, d_down


@_gathered_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
      down: torch.Tensor, weights: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(up), torch.empty_like(down)


def _gathered_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:  # Any: autograd ctx
    x, routes, gate, up, down, weights = inputs
    ctx.save_for_backward(x, routes, gate, up, down)
    ctx.weights = weights


def _gathered_grad(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # Any: autograd ctx
    x, routes, gate, up, down = ctx.saved_tensors
    dx, d_gate, d_up, d_down = _gathered_backward(dy, x, routes, gate, up, down, ctx.weights)
    return dx, None, d_gate, d_up, d_down, None


_gathered_forward.register_autograd(_gathered_grad, setup_context=_gathered_setup)


def routed_experts_pytorch(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                           down: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """x [N, H], routes [N, K] int64, gate/up [E, H, W], down [E, W, H] -> [N, H]."""
    return _gathered_forward(x, routes, gate, up, down, [float(w) for w in weights])


def routed_experts_masked(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                          down: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """Every expert on every token, weighted by the route mask: three dense GEMMs of E·W columns
    and a few elementwise ops, no sort and no host sync. Twice the routed FLOPs with top-2 of 4,
    but at small expert widths (4 × 64 at 200m) dense GEMMs can beat a grouped kernel bound by
    launches; ``expert_probe`` measures which wins per shape on the GPU. Plain torch ops: autograd
    differentiates it and ``torch.compile`` fuses its elementwise part."""
    experts = torch.arange(gate.shape[0], device=routes.device)
    hits = sum(float(w) * (routes[:, k, None] == experts) for k, w in enumerate(weights))
    coef = cast(torch.Tensor, hits).to(x.dtype)  # [N, E]
    g = torch.einsum("nh,ehw->new", x, gate)  # [N, E, W]
    u = torch.einsum("nh,ehw->new", x, up)
    return torch.einsum("new,ewh->nh", F.silu(g) * u * coef[:, :, None], down)


def routed_experts(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, weights: Sequence[float] = (0.5, 0.5),
                   backend: str = "pytorch") -> torch.Tensor:
    """Σ_k w_k · down_e(silu(x·gate_e) * (x·up_e)), e = routes[:, k]; routed scale left to caller."""
    if backend == "pytorch":
        fn = routed_experts_pytorch
    elif backend == "triton":
        # lazy: Triton is optional (CUDA only); importing it costs seconds on every CPU run
        from ds_trhash.kernels.routed_experts import routed_experts_triton as fn
    elif backend == "masked":
        fn = routed_experts_masked
    else:
        raise ValueError(f"unknown experts backend {backend!r}; allowed: {list(EXPERT_BACKENDS)}")
    run_dtype = autocast_dtype(x)
    if run_dtype is None:
        return fn(x, routes, gate, up, down, weights)
    y = fn(x.to(run_dtype), routes, gate.to(run_dtype), up.to(run_dtype), down.to(run_dtype), weights)
    return y.to(x.dtype)
