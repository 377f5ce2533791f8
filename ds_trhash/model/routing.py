"""Token-id hash routing (docs/contracts.md §1 "Routing is data, not code").

Routes are built once from (seed, layer, token id) and then persisted as buffers; everything
here is deterministic integer arithmetic so that two machines build bit-identical tables.
The builders are vectorised in numpy because a 200M model needs 16 tables of 32,000 tokens
at construction time and a Python loop would dominate model start-up.
"""
from __future__ import annotations

from itertools import combinations
from typing import overload

import numpy as np
import torch

from ds_trhash.errors import UserError


MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_CHANNEL_STEP = 0x85EBCA77
_EXPERT_XOR = 0xC2B2AE3D


class RouteTableError(UserError, ValueError):
    """A route table that must not be used: training on it would silently change the model."""


@overload
def mix32(v: int) -> int: ...
@overload
def mix32(v: np.ndarray) -> np.ndarray: ...
def mix32(v: int | np.ndarray) -> int | np.ndarray:
    """32-bit finaliser hash; accepts a Python int or an integer numpy array.

    Works in uint64 and masks after each multiply, so no intermediate can overflow
    (both factors are < 2**32).
    """
    scalar = isinstance(v, (int, np.integer))
    x = np.asarray(v, dtype=np.uint64) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(MASK32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    return int(x) if scalar else x


def route_scores(vocab_size: int, num_experts: int, layer: int, seed: int, channels: int = 2) -> np.ndarray:
    """int64 [V, E] multi-hash scores; summed unmasked in 64 bits as docs/contracts.md §1.1 requires."""
    tokens = np.arange(vocab_size, dtype=np.uint64)
    layer_salt = (seed + layer * _GOLDEN) & MASK32
    scores = np.zeros((vocab_size, num_experts), dtype=np.int64)
    for h in range(channels):
        c = (layer_salt + h * _CHANNEL_STEP) & MASK32
        for e in range(num_experts):
            salt = mix32(e + (c ^ _EXPERT_XOR))
            scores[:, e] += mix32(tokens ^ np.uint64(salt ^ c)).astype(np.int64)
    return scores


def build_route_table(vocab_size: int, num_experts: int, layer: int, seed: int,
                      channels: int = 2) -> torch.Tensor:
    """int64 [2, V]: row k holds each token's expert with the k-th largest score.

    Equal scores are broken towards the lower expert id (stable sort), which keeps the two
    routes distinct by construction; validation still runs so a bad table is never returned.
    """
    scores = route_scores(vocab_size, num_experts, layer, seed, channels)
    order = np.argsort(-scores, axis=1, kind="stable")  # [V, E], best expert first
    table = torch.from_numpy(np.ascontiguousarray(order[:, :2].T)).to(torch.int64)
    validate_route_table(table, vocab_size, num_experts)
    return table


def expert_pairs(num_experts: int) -> torch.Tensor:
    """int32 [P, 2]: every unordered expert pair, lexicographic ((0,1), (0,2), ...)."""
    return torch.tensor(list(combinations(range(num_experts), 2)), dtype=torch.int32)


def pair_codes(route_table: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """uint8 [V]: pair_index | (swap << 3), swap = 1 when the primary is the larger id.

    The layout is the released format; it is only unambiguous while P <= 8 (<= 4 experts),
    which covers every released model. Consumers that need more experts read route_table.
    """
    num_experts = int(pairs.max().item()) + 1
    lookup = torch.full((num_experts, num_experts), -1, dtype=torch.int64)
    index = torch.arange(pairs.shape[0], dtype=torch.int64)
    lookup[pairs[:, 0].long(), pairs[:, 1].long()] = index
    primary, secondary = route_table[0].cpu(), route_table[1].cpu()
    low, high = torch.minimum(primary, secondary), torch.maximum(primary, secondary)
    pair_index = lookup[low, high]
    if (pair_index < 0).any():
        raise RouteTableError("route table holds a token whose expert pair is not in fused_expert_pairs")
    swap = (primary > secondary).to(torch.int64)
    return (pair_index | (swap << 3)).to(torch.uint8)


def validate_route_table(table: torch.Tensor, vocab_size: int, num_experts: int) -> None:
    """Refuse a table that cannot be the routing of a (vocab_size, num_experts) model."""
    if not isinstance(table, torch.Tensor):
        raise RouteTableError(f"route table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise RouteTableError(f"route table must be int64, got {table.dtype}")
    if tuple(table.shape) != (2, vocab_size):
        raise RouteTableError(f"route table must have shape [2, {vocab_size}], got {list(table.shape)}")
    if table.is_meta:
        return  # nothing to inspect yet; checked again once real values exist
    values = table.detach().cpu().numpy()  # numpy: tiny integer checks, no thread-pool start-up
    bad = np.flatnonzero(((values < 0) | (values >= num_experts)).any(axis=0))
    if bad.size:
        raise RouteTableError(
            f"route table sends tokens {bad[:8].tolist()} to experts outside [0, {num_experts - 1}]")
    same = np.flatnonzero(values[0] == values[1])
    if same.size:
        raise RouteTableError(
            f"route table gives {same.size} tokens the same primary and secondary expert; "
            f"first offending token ids: {same[:8].tolist()}")
