"""A corpus of random token rows with its replay plan, for a launch of the 200m shape (not a test).

    python bench/synthetic_corpus.py OUT_DIR [--steps 40] [--rows-per-step 16] [--seq-len 2048]

The embedded demo corpus holds about 150,000 tokens: 4 steps of 16 rows of 2,048. A launch that
measures its steady tokens/s needs more steps, and the data's content does not matter to the
speed, so this writes two sources of uniformly random token ids (vocabulary 32,000) as shards
in the release's format, and a plan over them (``OUT_DIR/plan.json``, ``OUT_DIR/shards``).
Launch with ``--set data.plan=OUT_DIR/plan.json --set data.shards_dir=OUT_DIR/shards --set
data.target_tokens=null --set data.tokenizer=null`` (bench/gpu_session.sh does).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


from ds_trhash.data.formats.shards import load_manifests, write_shards
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.plans.plan import write_plan


def write_corpus(out: Path, steps: int, rows_per_step: int, seq_len: int) -> Path:
    rows = steps * rows_per_step // 2 + rows_per_step  # per source, a step to spare
    rng = np.random.default_rng(0)
    shards = out / "shards"
    for source in ("a", "b"):
        stream = rng.integers(1, 32000, rows * seq_len + 1)
        write_shards(source, [stream], seq_len, 64, shards, vocab_size=32000, tokenizer_hash="synthetic")
    manifests = load_manifests([shards])
    total = sum(m["total_rows"] for m in manifests.values()) * seq_len
    plan = build_plan(manifests, total, dataset="synthetic", revision="main")
    write_plan(plan, out / "plan.json")
    return out / "plan.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows-per-step", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    print(write_corpus(args.out, args.steps, args.rows_per_step, args.seq_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
