"""Dense masked routed-expert reference, shared by the tests and bench/bench_experts.py.

It computes every expert on every token and masks by the routes, so it shares no sorting or
gathering logic with the implementation it checks.
"""
import torch
import torch.nn.functional as F


def masked_reference(x, routes, gate, up, down, weights):
    """x [N, H], routes [N, 2], gate/up [E, H, W], down [E, W, H] -> [N, H]."""
    out = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        y = (F.silu(x @ gate[e]) * (x @ up[e])) @ down[e]  # expert e on all tokens
        mask = sum(w * (routes[:, k] == e).to(x.dtype) for k, w in enumerate(weights))
        out = out + mask[:, None] * y
    return out
