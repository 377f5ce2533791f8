"""What counting the per-expert token load costs a training step (not a test).

    .venv/bin/python bench/bench_expert_load.py [--preset tiny] [--batch 4] [--seq 128] [--reps 20]

Times one forward + backward of the model with ``track_expert_load`` off and on (alternating,
``--reps`` each, after two warm-up steps), and the counting alone (``_count_expert_load`` on the
same ids), on this machine's default device. Prints the medians it measured and the difference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ds_trhash.model import TRHashConfig, TRHashForCausalLM


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(model, ids, device, track: bool) -> float:
    model.track_expert_load = track
    _sync(device)
    t0 = time.perf_counter()
    model(ids, labels=ids).backward()
    model.take_expert_load()
    _sync(device)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset(args.preset)
    model = TRHashForCausalLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    for _ in range(2):
        step_seconds(model, ids, device, True)
    off, on = [], []
    for _ in range(args.reps):
        off.append(step_seconds(model, ids, device, False))
        on.append(step_seconds(model, ids, device, True))
    count = []
    for _ in range(args.reps):
        _sync(device)
        t0 = time.perf_counter()
        model._count_expert_load(ids)
        _sync(device)
        count.append(time.perf_counter() - t0)
    model.take_expert_load()
    m_off, m_on, m_count = statistics.median(off), statistics.median(on), statistics.median(count)
    print(f"preset {args.preset} ({cfg.num_layers} layers x {cfg.num_experts} experts), batch {args.batch} x seq "
          f"{args.seq} on {device}, {torch.get_num_threads()} thread(s), {args.reps} reps each")
    print(f"forward+backward, counting off: median {m_off * 1e3:.2f} ms (min {min(off) * 1e3:.2f})")
    print(f"forward+backward, counting on:  median {m_on * 1e3:.2f} ms (min {min(on) * 1e3:.2f})")
    print(f"difference of medians: {(m_on - m_off) * 1e3:+.2f} ms ({(m_on / m_off - 1) * 100:+.2f} %)")
    print(f"counting alone: median {m_count * 1e6:.0f} us ({m_count / m_off * 100:.2f} % of a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
