"""Routed SwiGLU experts: the PyTorch gathered path and the dispatch to fused kernels.

The gathered path is the numerical reference for the Triton kernels (docs/contracts.md §7), so it is kept
plain: each expert runs only on the tokens routed to it (half the FLOPs of computing every
expert on every token with top-2 of 4), and results are scattered back with their weight.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

EXPERT_BACKENDS = ("pytorch", "triton")


def routed_experts_pytorch(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                           down: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """x [N, H], routes [N, K] int64, gate/up [E, H, W], down [E, W, H] -> [N, H]."""
    n, k = routes.shape
    flat_expert = routes.reshape(-1)  # [N*K], token-major
    flat_token = torch.arange(n, device=x.device).repeat_interleave(k)
    flat_weight = torch.as_tensor(list(weights), dtype=x.dtype, device=x.device).repeat(n)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=gate.shape[0]).tolist()
    tokens_by_expert = flat_token[order].split(counts)
    weights_by_expert = flat_weight[order].split(counts)
    out = torch.zeros_like(x)  # filled in place: one [N, H] buffer however many experts
    for e, (idx, w) in enumerate(zip(tokens_by_expert, weights_by_expert)):
        if idx.numel() == 0:
            continue  # an idle expert costs nothing; its weight gradient stays zero
        xe = x.index_select(0, idx)  # [n_e, H]
        gate_up = xe @ torch.cat((gate[e], up[e]), dim=1)  # one GEMM for both: [n_e, 2W]
        g, u = gate_up.chunk(2, dim=1)
        he = F.silu(g) * u * w[:, None]  # route weight applied at width W, not H
        # under autocast the product is low precision while out follows x: add in out's dtype
        out.index_add_(0, idx, (he @ down[e]).to(out.dtype))
    return out


def routed_experts(x: torch.Tensor, routes: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor, weights: Sequence[float] = (0.5, 0.5),
                   backend: str = "pytorch") -> torch.Tensor:
    """Σ_k w_k · down_e(silu(x·gate_e) * (x·up_e)), e = routes[:, k]; routed scale left to caller."""
    if backend == "pytorch":
        return routed_experts_pytorch(x, routes, gate, up, down, weights)
    if backend == "triton":
        # lazy: Triton is optional (CUDA only); importing it costs seconds on every CPU run
        from ds_trhash.kernels.routed_experts import routed_experts_triton

        return routed_experts_triton(x, routes, gate, up, down, weights)
    raise ValueError(f"unknown experts backend {backend!r}; allowed: {list(EXPERT_BACKENDS)}")
