import time

import numpy as np
import pytest
import torch

from ds_trhash.model.routing import (RouteTableError, build_route_table, expert_pairs, mix32, pair_codes,
                                     route_scores, validate_route_table)

SEED = 0x71D5A17
M = 0xFFFFFFFF


def scalar_mix32(v):
    """Straight transcription of the routing formula (docs/contracts.md §1.1) in Python ints."""
    v &= M
    v ^= v >> 16
    v = (v * 0x7FEB352D) & M
    v ^= v >> 15
    v = (v * 0x846CA68B) & M
    return v ^ (v >> 16)


def scalar_scores(token, num_experts, layer, seed, channels=2):
    salt = (seed + layer * 0x9E3779B1) & M
    scores = [0] * num_experts
    for h in range(channels):
        c = (salt + h * 0x85EBCA77) & M
        for e in range(num_experts):
            s_e = scalar_mix32(e + (c ^ 0xC2B2AE3D))
            scores[e] += scalar_mix32(token ^ s_e ^ c)
    return scores


def test_mix32_matches_the_scalar_formula_on_scalars_and_arrays():
    values = [0, 1, 2**31, M, 0x12345678, 0x9E3779B1]
    assert [mix32(v) for v in values] == [scalar_mix32(v) for v in values]
    assert mix32(np.array(values, dtype=np.uint64)).tolist() == [scalar_mix32(v) for v in values]


@pytest.mark.parametrize("layer", [0, 7])
def test_vectorised_scores_match_the_scalar_formula(layer):
    tokens = [0, 1, 2, 999, 31999]
    scores = route_scores(32000, 4, layer, SEED)
    for t in tokens:
        assert scores[t].tolist() == scalar_scores(t, 4, layer, SEED)


def test_spec_vectors_layer_0():
    table = build_route_table(32000, 4, 0, SEED)
    assert table.dtype == torch.int64 and table.shape == (2, 32000)
    assert table[0, :8].tolist() == [0, 2, 1, 3, 1, 3, 0, 3]
    assert table[1, :8].tolist() == [3, 0, 3, 1, 2, 0, 3, 2]
    assert torch.bincount(table.flatten(), minlength=4).tolist() == [15954, 16118, 15917, 16011]
    codes = pair_codes(table, expert_pairs(4))
    assert codes.dtype == torch.uint8 and codes.shape == (32000,)
    assert codes[:8].tolist() == [2, 9, 4, 12, 3, 10, 2, 13]


def test_primary_route_has_the_largest_score():
    scores = torch.from_numpy(route_scores(4096, 4, 3, SEED))
    table = build_route_table(4096, 4, 3, SEED)
    top2 = scores.topk(2, dim=1).values
    assert torch.equal(scores.gather(1, table.t()), top2)


def test_layers_get_different_routes():
    assert not torch.equal(build_route_table(4096, 4, 0, SEED), build_route_table(4096, 4, 1, SEED))


def test_expert_pairs_are_lexicographic():
    assert expert_pairs(4).tolist() == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]
    assert expert_pairs(4).dtype == torch.int32
    assert expert_pairs(2).tolist() == [[0, 1]]
    assert expert_pairs(8).shape == (28, 2)


def test_pair_codes_decode_back_to_the_routes():
    table = build_route_table(4096, 4, 2, SEED)
    pairs = expert_pairs(4)
    codes = pair_codes(table, pairs).long()
    pair = pairs[codes & 7].long()
    swap = (codes >> 3).bool()
    primary = torch.where(swap, pair[:, 1], pair[:, 0])
    secondary = torch.where(swap, pair[:, 0], pair[:, 1])
    assert torch.equal(primary, table[0]) and torch.equal(secondary, table[1])


def test_building_all_200m_tables_is_vectorised():
    start = time.perf_counter()
    for layer in range(16):
        build_route_table(32000, 4, layer, SEED)
    # ~0.1 s vectorised; a per-token Python loop takes tens of seconds. Loose for shared CPUs.
    assert time.perf_counter() - start < 3.0


def test_validate_accepts_a_built_table():
    validate_route_table(build_route_table(100, 4, 0, SEED), 100, 4)


@pytest.mark.parametrize("make,message", [
    (lambda t: t[:, :99], r"shape \[2, 100\]"),
    (lambda t: t.to(torch.int32), "int64"),
    (lambda t: t.numpy(), "torch.Tensor"),
])
def test_validate_refuses_wrong_shape_dtype_type(make, message):
    with pytest.raises(RouteTableError, match=message):
        validate_route_table(make(build_route_table(100, 4, 0, SEED)), 100, 4)


def test_validate_names_tokens_with_out_of_range_experts():
    table = build_route_table(100, 4, 0, SEED)
    table[1, 17] = 4
    table[0, 42] = -1
    with pytest.raises(RouteTableError, match=r"tokens \[17, 42\]"):
        validate_route_table(table, 100, 4)


def test_validate_names_tokens_whose_routes_coincide():
    table = build_route_table(100, 4, 0, SEED)
    table[1, 5] = table[0, 5]
    table[1, 60] = table[0, 60]
    with pytest.raises(RouteTableError, match=r"2 tokens.*first offending token ids: \[5, 60\]"):
        validate_route_table(table, 100, 4)
    assert issubclass(RouteTableError, ValueError)
