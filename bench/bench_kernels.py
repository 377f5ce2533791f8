"""GPU benchmark of the fused kernels at the TR-HASH 200M shape (not a test; needs CUDA).

    .venv/bin/python bench/bench_kernels.py [--tokens 32768] [--iters 20] [--json out.json]

1. Routed experts, forward + backward, bf16: Triton (ds_trhash.kernels.routed_experts) vs the
   PyTorch gathered reference (ds_trhash.model.experts.routed_experts_pytorch) vs the dense
   masked path (routed_experts_masked: every expert on every token; eager and under
   torch.compile), at N = 16 x 2048 tokens, H 896, W 64, E 4, routes from the layer-0 hash
   route table. The speed target is against the gathered path; the masked rows say whether the
   per-shape probe (ds_trhash.model.expert_probe) should pick the kernel at this shape.
2. Tied-head cross entropy, forward + backward, bf16: Liger fused linear CE vs the chunked CE
   vs the plain CE (ds_trhash.model.loss) at hidden [N, 896] x embedding [32000, 896].

For each: median time per fwd+bwd over --iters timed runs (after warm-up, which also runs the
Triton autotuner), peak memory above the inputs (torch.cuda.max_memory_allocated delta), and
the max difference from the PyTorch reference. Prints what it measured; nothing is assumed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ds_trhash.model.loss import IGNORE_INDEX


def _timed(fn, iters: int, warmup: int):
    """Median milliseconds of fn() and peak bytes allocated above the state before it."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), peak


def _report(rows, title):
    print(f"\n{title}")
    print(f"{'path':<24}{'fwd+bwd ms':>12}{'peak MiB':>12}{'max |diff|':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['path']:<24}failed: {r['error']}")
            continue
        diff = "reference" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3e}"
        print(f"{r['path']:<24}{r['ms']:>12.3f}{r['peak_mib']:>12.1f}{diff:>14}")


def bench_experts(n_tokens: int, iters: int, warmup: int, device: torch.device):
    from ds_trhash.kernels.routed_experts import routed_experts_triton
    from ds_trhash.model.config import TRHashConfig
    from ds_trhash.model.experts import routed_experts_masked, routed_experts_pytorch
    from ds_trhash.model.routing import build_route_table

    cfg = TRHashConfig.from_preset("200m")
    H, W, E = cfg.hidden_size, cfg.expert_width, cfg.num_experts
    gen = torch.Generator(device="cpu").manual_seed(0)
    table = build_route_table(cfg.vocab_size, E, 0, cfg.route_seed)
    ids = torch.randint(0, cfg.vocab_size, (n_tokens,), generator=gen)
    routes = table[:, ids].t().contiguous().to(device)
    dt = torch.bfloat16
    x = (torch.randn(n_tokens, H, generator=gen)).to(device, dt).requires_grad_()
    gate = (0.02 * torch.randn(E, H, W, generator=gen)).to(device, dt).requires_grad_()
    up = (0.02 * torch.randn(E, H, W, generator=gen)).to(device, dt).requires_grad_()
    down = (0.02 / (2 * cfg.num_layers) ** 0.5 * torch.randn(E, W, H, generator=gen)).to(device, dt).requires_grad_()
    dy = torch.randn(n_tokens, H, generator=gen).to(device, dt)
    leaves = (x, gate, up, down)

    def run(fn):
        def step():
            y = fn(x, routes, gate, up, down, cfg.route_weights)
            return y, torch.autograd.grad(y, leaves, dy)
        return step

    paths = {"pytorch (gathered)": routed_experts_pytorch, "triton": routed_experts_triton,
             "masked": routed_experts_masked, "masked (torch.compile)": torch.compile(routed_experts_masked)}
    ref_y, ref_g = run(routed_experts_pytorch)()
    rows = []
    for name, fn in paths.items():
        try:
            y, g = run(fn)()
            ms, peak = _timed(run(fn), iters, warmup)
        except Exception as exc:  # recorded; the next path still runs
            rows.append({"path": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        diff = None if name.startswith("pytorch") else max(
            (a.float() - b.float()).abs().max().item() for a, b in zip((y, *g), (ref_y, *ref_g)))
        rows.append({"path": name, "ms": ms, "peak_mib": peak / 2**20, "max_abs_diff": diff})
    _report(rows, f"routed experts fwd+bwd: N={n_tokens} H={H} W={W} E={E} bf16")
    return rows


def bench_loss(n_tokens: int, iters: int, warmup: int, device: torch.device, chunk: int):
    from ds_trhash.model.loss import tied_ce

    V, H = 32000, 896
    gen = torch.Generator(device="cpu").manual_seed(1)
    dt = torch.bfloat16
    hidden = torch.randn(n_tokens, H, generator=gen).to(device, dt).requires_grad_()
    weight = (0.02 * torch.randn(V, H, generator=gen)).to(device, dt).requires_grad_()
    labels = torch.randint(0, V, (n_tokens,), generator=gen).to(device)
    labels[::7] = IGNORE_INDEX  # some unsupervised positions, as in SFT

    def run(backend):
        def step():
            loss = tied_ce(hidden, weight, labels, backend, chunk_tokens=chunk)
            return loss, torch.autograd.grad(loss, (hidden, weight))
        return step

    names = {"plain": "plain CE", "chunked": f"chunked CE ({chunk})", "liger": "liger fused linear CE"}
    outs = {}
    rows = []
    for backend in ("plain", "chunked", "liger"):
        try:
            outs[backend] = run(backend)()
            ms, peak = _timed(run(backend), iters, warmup)
        except Exception as exc:  # e.g. Liger missing or out of memory: say so, keep going
            print(f"{names[backend]}: failed ({type(exc).__name__}: {exc})")
            torch.cuda.empty_cache()
            continue
        diff = None
        if backend != "plain" and "plain" in outs:
            (l0, g0), (l1, g1) = outs["plain"], outs[backend]
            diff = max([abs(l0.item() - l1.item())] + [(a.float() - b.float()).abs().max().item()
                                                        for a, b in zip(g0, g1)])
        rows.append({"path": names[backend], "ms": ms, "peak_mib": peak / 2**20, "max_abs_diff": diff})
    _report(rows, f"tied CE fwd+bwd: hidden [{n_tokens}, {H}] x embedding [{V}, {H}] bf16")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16 * 2048, help="tokens per call (16 x 2048)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1024, help="chunked CE tokens per chunk")
    ap.add_argument("--only", choices=("experts", "loss"), default=None)
    ap.add_argument("--json", default=None, help="also write the measured rows here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; this benchmark measures GPU kernels and has "
              "nothing to measure on CPU (run it on a CUDA machine, e.g. the H200).", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    result = {"device": torch.cuda.get_device_name(device), "tokens": args.tokens}
    if args.only in (None, "experts"):
        result["experts"] = bench_experts(args.tokens, args.iters, args.warmup, device)
    if args.only in (None, "loss"):
        result["loss"] = bench_loss(args.tokens, args.iters, args.warmup, device, args.chunk)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
