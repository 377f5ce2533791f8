"""Launches of the Triton routed experts: Triton kernels and torch ops per forward and backward.

The kernel is bound by launches, not arithmetic, at the 200m shape (docs/performance.md), so
this counts them: each Triton kernel launch (the module's kernels are wrapped to count their
calls) and each top-level torch op (``torch.profiler``: an ``aten::`` call with no ``aten::``
call above it and outside every Triton launch, which under the CPU interpreter issues torch ops
of its own), for one forward and one backward of ``routed_experts_triton``. Counts, not times:
the same on CPU (``TRITON_INTERPRET=1``, set here) and on a GPU, except for the kernels'
autotuning. ``.venv/bin/python bench/count_expert_ops.py`` prints the table; ``--json PATH``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

TRITON_TAG = "triton::"


def _wrap_kernels(rk, launches: collections.Counter) -> None:
    for name in dir(rk):
        kernel = getattr(rk, name)
        if name.endswith("_kernel") and hasattr(kernel, "run"):
            def run(*args, _inner=kernel.run, _name=name, **kwargs):
                launches[_name] += 1
                with record_function(TRITON_TAG + _name):
                    return _inner(*args, **kwargs)
            kernel.run = run


def _top_level_ops(prof) -> collections.Counter:
    ops: collections.Counter = collections.Counter()
    for evt in prof.events():
        if not evt.name.startswith("aten::"):
            continue
        parent, nested = evt.cpu_parent, False
        while parent is not None and not nested:
            nested = parent.name.startswith(("aten::", TRITON_TAG))
            parent = parent.cpu_parent
        if not nested:
            ops[evt.name] += 1
    return ops


def count(n: int, h: int, w: int, e: int, dtype: torch.dtype, device: str) -> dict:
    from ds_trhash.kernels import routed_experts as rk

    launches: collections.Counter = collections.Counter()
    _wrap_kernels(rk, launches)
    gen = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(n)]).to(device)
    x, gate, up = (torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in
                   ((n, h), (e, h, w), (e, h, w)))
    down = torch.randn(e, w, h, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(n, h, generator=gen).to(device, dtype)
    rk.routed_experts_triton(x, routes, gate, up, down)  # autotuning and compiles out of the count
    torch.autograd.grad(rk.routed_experts_triton(x, routes, gate, up, down), (x, gate, up, down), dy)
    result = {}
    for phase in ("forward", "backward"):
        launches.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if phase == "forward":
                y = rk.routed_experts_triton(x, routes, gate, up, down)
            else:
                torch.autograd.grad(y, (x, gate, up, down), dy)
        ops = _top_level_ops(prof)
        result[phase] = {"triton_launches": sum(launches.values()), "kernels": dict(launches),
                         "torch_ops": sum(ops.values()), "ops": dict(sorted(ops.items()))}
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64,32,16,4", help="N,H,W,E (default 64,32,16,4; GPU: 32768,896,64,4)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    n, h, w, e = (int(v) for v in args.shape.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = count(n, h, w, e, getattr(torch, args.dtype), device)
    for phase, r in result.items():
        print(f"{phase:8s}  {r['triton_launches']} Triton launches {r['kernels']}")
        print(f"{'':8s}  {r['torch_ops']} torch ops {r['ops']}")
    total = {k: sum(r[k] for r in result.values()) for k in ("triton_launches", "torch_ops")}
    print(f"total     {total['triton_launches']} Triton launches, {total['torch_ops']} torch ops")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": [n, h, w, e], "dtype": args.dtype, "device": device, **result, "total": total},
                      fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
