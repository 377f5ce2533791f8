"""Peak memory of one attention layer over packed rows: dense document mask vs the project's paths.

Not a test: run `python bench/bench_attention.py` (defaults: 200m attention shape, sequence
2,048, micro batch 2, fp32, CPU; 8 documents per row). Each variant runs forward + backward of
one ``TRHashAttention`` in a fresh subprocess, so the peak resident memory (ru_maxrss) above the
memory held once the inputs exist is that variant's own:

dense      SDPA with the dense [B, 1, T, T] document mask (the model's former packed path)
blockwise  the model's CPU path: query blocks of 128 with [B, 1, 128, <=T] masks, checkpointed
flex       flex attention with the document BlockMask (CUDA only: its backward is CUDA-only in
           torch 2.13; on CUDA the peak is torch.cuda.max_memory_allocated)
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

VARIANTS = ("dense", "blockwise", "flex")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_one(args) -> dict:
    from ds_trhash.model import TRHashConfig
    from ds_trhash.model.attention import TRHashAttention, build_document_mask, document_mask

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    cfg = TRHashConfig.from_preset(args.preset)
    attn = TRHashAttention(cfg).to(device=device, dtype=dtype)
    b, t = args.micro_batch, args.seq_len
    x = torch.randn(b, t, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    docs = (torch.arange(t, device=device) * args.documents // t).expand(b, t).contiguous()
    positions = torch.arange(t, device=device).expand(b, t)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mib()
    start = time.perf_counter()
    if args.variant == "dense":
        mask = document_mask(docs)
    else:
        mask = build_document_mask(docs, flex=args.variant == "flex")
    out = attn(x, positions, mask)
    (out.float() ** 2).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"variant": args.variant, "peak_above_inputs_mib": round(peak, 1),
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="200m")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--documents", type=int, default=8, help="documents per packed row")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--variants", default=None, help="comma separated; default: dense,blockwise (+flex on CUDA)")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # the child process
    p.add_argument("--json")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_one(args)))
        return 0
    variants = args.variants.split(",") if args.variants else \
        ["dense", "blockwise"] + (["flex"] if args.device.startswith("cuda") else [])
    rows = []
    for v in variants:
        cmd = [sys.executable, __file__, "--variant", v] + [a for a in sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            rows.append({"variant": v, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
        if args.json:  # rewritten after each variant: a run cut short keeps what finished
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    mask_mib = args.micro_batch * args.seq_len ** 2 / 2**20
    print(f"{args.preset} attention, B={args.micro_batch} T={args.seq_len} {args.precision} on {args.device}; "
          f"a dense bool [B,1,T,T] mask alone is {mask_mib:.0f} MiB")
    for r in rows:
        print(f"  {r['variant']:<10} " + (f"peak {r['peak_above_inputs_mib']:>8.1f} MiB above inputs, "
                                          f"{r['seconds']:.1f} s" if "error" not in r else r["error"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
