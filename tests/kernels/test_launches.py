"""How much the routed-experts op launches (it is bound by launches at the 200m shape): the sort
done once per forward and reused by the backward, 2 Triton launches forward and 4 backward (+1 per
weight gradient with split-K partials), and fp32 autotuning pruned to one config per kernel."""
import os

import pytest
import torch
import triton

from ds_trhash.kernels import routed_experts as rk
from tests.kernels.test_routed_experts import make_case

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def launches(monkeypatch):
    counted = []
    for name in ("_gate_up_kernel", "_grouped_mm_kernel", "_grouped_dw_kernel", "_sum_splits_kernel"):
        kernel = getattr(rk, name)
        monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, _name=name, **kw: (counted.append(_name),
                                                                                           _run(*a, **kw))[1])
    sorts = []
    monkeypatch.setattr(rk, "_sort_assignments", lambda *a, _sort=rk._sort_assignments: (sorts.append(1), _sort(*a))[1])
    return counted, sorts


def test_forward_and_backward_launch_six_kernels_and_sort_once(launches):
    counted, sorts = launches
    x, routes, gate, up, down = make_case(37, 24, 12, 4)
    y = rk.routed_experts_triton(x, routes, gate, up, down)
    assert counted == ["_gate_up_kernel", "_grouped_mm_kernel"] and sorts == [1]
    counted.clear()
    torch.autograd.grad(y, (x, gate, up, down), torch.randn_like(y))
    assert sorted(counted) == ["_grouped_dw_kernel", "_grouped_dw_kernel", "_grouped_mm_kernel", "_grouped_mm_kernel"]
    assert sorts == [1]  # the backward reused the forward's sort


def test_split_k_adds_one_fixed_order_sum_per_weight_gradient(launches, monkeypatch):
    counted, _ = launches
    monkeypatch.setattr(rk, "_default_splits", lambda M, E: 3)
    x, routes, gate, up, down = make_case(37, 24, 12, 4)
    y = rk.routed_experts_triton(x.detach(), routes, gate, up, down)
    counted.clear()
    torch.autograd.grad(y, (gate, up, down), torch.randn_like(y))  # x needs no gradient: no dx kernel
    assert sorted(counted) == ["_grouped_dw_kernel", "_grouped_dw_kernel", "_grouped_mm_kernel",
                               "_sum_splits_kernel", "_sum_splits_kernel"]


def _gpu_configs(options):
    return [triton.Config(meta, num_warps=w, num_stages=s) for meta, w, s in options]


@pytest.mark.parametrize("kernel,options", [("_gate_up_kernel", rk.ROW_TILE_OPTIONS),
                                            ("_grouped_mm_kernel", rk.ROW_TILE_OPTIONS),
                                            ("_grouped_dw_kernel", rk.DW_OPTIONS)])
def test_fp32_tunes_one_config_and_other_dtypes_skip_blocks_wider_than_the_problem(kernel, options):
    prune = getattr(rk, kernel).early_config_prune
    configs = _gpu_configs(options)
    # the GPU tests' fp32: one compile per kernel variant instead of one per config
    assert prune(configs, {}, DOT_PRECISION="ieee") == configs[:1]
    sizes = {"_gate_up_kernel": {"W": 64, "H": 896}, "_grouped_mm_kernel": {"N": 64, "K": 896},
             "_grouped_dw_kernel": {"Q": 64, "P": 896}}[kernel]
    kept = prune(configs, sizes, DOT_PRECISION="tf32")  # a 200m expert: width 64
    wide = "BLOCK_Q" if kernel == "_grouped_dw_kernel" else "BLOCK_N"
    assert kept and all(c.kwargs[wide] <= 64 for c in kept) and configs[0] not in kept
    assert len(kept) < len(configs) - 1
    tiny = {name: 8 for name in sizes}  # narrower than every block: the smallest still runs
    assert len(prune(configs, tiny, DOT_PRECISION="tf32")) == 1
