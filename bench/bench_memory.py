"""The memory estimate against the device at a few micro-batch sizes (`batch.micro_batch: auto`'s probe).

GPU run (the figures that count):

    python bench/bench_memory.py --micro-batches 4,8,16 --json runs/memory.json
    # = ds_configs/200m/pretrain.yaml at seq 2048, bf16, ZeRO 1, kernels auto

For each size: the estimate of one rank (``ds-trhash model``'s total and its activation term) and
the peak ``torch.cuda.max_memory_allocated`` of the probe that ``auto`` runs (a throwaway model in
the training precision with the policy's kernels, forward and backward of random tokens, and one
allocation the size of the optimizer state and DeepSpeed's bucket): their ratio is the estimate's
error at that shape. A size out of memory is reported as such. CPU: refused (nothing to measure).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ds_trhash.training import config as tcfg
from ds_trhash.training.memory.auto import DeviceProbe
from ds_trhash.training.preparation.footprint import GIB, estimate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="ds_configs/200m/pretrain.yaml")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", default="4,8,16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_memory: no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    sizes = [int(m) for m in args.micro_batches.split(",")]
    cfg = tcfg.load_config(args.config, overrides=[f"data.seq_len={args.seq_len}", "batch.global_tokens=null",
                                                   "batch.grad_accum=1", "batch.micro_batch=1"])
    device = torch.device("cuda", torch.cuda.current_device())
    probe = DeviceProbe(cfg, tcfg.model_config(cfg), 1, device)
    rows = []
    for m in sizes:
        c = tcfg.with_micro_batch(cfg, m)
        foot = estimate(c, tcfg.model_config(c), 1, "cuda")
        peak = probe.peak(m)
        rows.append({"micro_batch": m, "seq_len": args.seq_len, "estimate_gib": foot.per_rank / GIB,
                     "estimate_activations_gib": foot.activations / GIB,
                     "probe_peak_gib": None if peak is None else peak / GIB,
                     "ratio": None if peak is None else foot.per_rank / peak,
                     "device": torch.cuda.get_device_name(device), "capacity_gib": probe.capacity() / GIB})
        r = rows[-1]
        print(f"micro-batch {m:>3} x {args.seq_len}: estimate {r['estimate_gib']:.2f} GiB (activations "
              f"{r['estimate_activations_gib']:.2f}), probe peak "
              + ("out of memory" if peak is None else f"{r['probe_peak_gib']:.2f} GiB, estimate/measured {r['ratio']:.3f}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
