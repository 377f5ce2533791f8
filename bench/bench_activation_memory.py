"""Memory saved by activation checkpointing at the 200m shape on CPU (not a test).

    .venv/bin/python bench/bench_activation_memory.py [--seq 2048] [--micro-batch 1] [--modes none full every_n]

Each mode runs in its own fresh process (so one mode's peak cannot hide another's): build the
200m model in fp32, one forward + backward of a micro-batch of random token ids with the loss,
and report

* peak RSS of the process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), before and after
  the step, so the step's own growth is visible apart from weights and gradients;
* bytes autograd saved for backward during the forward (``torch.autograd.graph.saved_tensors_hooks``),
  which is what checkpointing removes;
* wall time of the step.

Prints what it measured; nothing is assumed.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(mode: str, every: int, seq: int, micro_batch: int) -> dict:
    import torch

    from ds_trhash.model import TRHashConfig, TRHashForCausalLM

    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset("200m")
    model = TRHashForCausalLM(cfg)
    layers = model.set_activation_checkpointing(mode, every)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq))
    rss_model = _rss_mib()
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids, reduction="mean")
    rss_forward = _rss_mib()
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"mode": mode, "every": every if mode == "every_n" else None, "checkpointed_layers": len(layers),
            "seq": seq, "micro_batch": micro_batch, "threads": torch.get_num_threads(),
            "peak_rss_before_step_mib": round(rss_model), "peak_rss_after_forward_mib": round(rss_forward),
            "peak_rss_after_backward_mib": round(_rss_mib()), "saved_for_backward_mib": round(saved / 2**20),
            "step_seconds": round(seconds, 1), "loss": round(float(loss), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--every", type=int, default=2, help="n of every_n")
    p.add_argument("--modes", nargs="+", default=["none", "full", "every_n"])
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this mode in this process
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.every, args.seq, args.micro_batch)))
        return 0
    rows = []
    for mode in args.modes:
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--every", str(args.every), "--seq",
                              str(args.seq), "--micro-batch", str(args.micro_batch)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"\n200m, fp32, CPU, seq {args.seq}, micro-batch {args.micro_batch}, forward+backward with loss")
    print(f"{'mode':>10} {'layers':>6} {'peak RSS MiB':>13} {'step growth MiB':>16} {'saved for bwd MiB':>18} {'s':>6}")
    for r in rows:
        growth = r["peak_rss_after_backward_mib"] - r["peak_rss_before_step_mib"]
        print(f"{r['mode'] + (str(r['every']) if r['every'] else ''):>10} {r['checkpointed_layers']:>6} "
              f"{r['peak_rss_after_backward_mib']:>13} {growth:>16} {r['saved_for_backward_mib']:>18} "
              f"{r['step_seconds']:>6}")
    for r in rows[1:]:
        print(f"{r['mode']}: peak RSS {base['peak_rss_after_backward_mib'] - r['peak_rss_after_backward_mib']} MiB "
              f"lower, saved activations {base['saved_for_backward_mib'] - r['saved_for_backward_mib']} MiB lower "
              f"than none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
