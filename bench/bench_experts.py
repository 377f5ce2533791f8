"""Time forward+backward of the routed-expert block: gathered path vs dense masked reference.

Not a test: run `python bench/bench_experts.py` (defaults are the 200M shapes on CPU, 8,192
tokens). The gathered path computes 2 of 4 experts per token, so ~2x is the FLOP bound; the
target is >= 1.8x. The reference is the one the tests use (tests/model/reference.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from reference import masked_reference  # noqa: E402

from ds_trhash.model.experts import routed_experts  # noqa: E402
from ds_trhash.model.routing import build_route_table  # noqa: E402


def make_inputs(tokens: int, hidden: int, experts: int, width: int, vocab: int = 32000):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    routes = build_route_table(vocab, experts, 0, 0x71D5A17)[:, ids].t().contiguous()
    x = torch.randn(tokens, hidden, generator=gen)
    params = [torch.randn(experts, hidden, width, generator=gen) * 0.02,
              torch.randn(experts, hidden, width, generator=gen) * 0.02,
              torch.randn(experts, width, hidden, generator=gen) * 0.02]
    return routes, [t.requires_grad_() for t in (x, *params)]


def time_fwd_bwd(fn, routes, tensors, repeats: int) -> float:
    """Median seconds of one forward+backward; the first call is a discarded warm-up."""
    times = []
    for i in range(repeats + 1):
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        fn(tensors[0], routes, *tensors[1:], (0.5, 0.5)).sum().backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    routes, tensors = make_inputs(args.tokens, args.hidden, args.experts, args.width)
    gathered = time_fwd_bwd(routed_experts, routes, tensors, args.repeats)
    dense = time_fwd_bwd(masked_reference, routes, tensors, args.repeats)
    print(f"routed experts fwd+bwd, {args.tokens} tokens, hidden {args.hidden}, "
          f"{args.experts} experts x width {args.width}, {torch.get_num_threads()} threads")
    print(f"  gathered (pytorch path): {gathered * 1e3:8.1f} ms")
    print(f"  dense masked reference:  {dense * 1e3:8.1f} ms")
    print(f"  speed-up: {dense / gathered:.2f}x (target >= 1.8x)")


if __name__ == "__main__":
    main()
