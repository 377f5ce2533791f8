"""Time `ds-trhash data plan` (and `data correct-plan`) over the manifests of a 1,000-shard corpus.

Not a test: it prints what it measured. The corpus is manifests only, in the release's layout
(mixture_manifest.json + corpora/<source>/manifest.json), shards of the release's size (976,562
rows of 1,024 tokens, about 2 GB each, so the corpus it describes is about 2 TB); no shard file
exists, which is the point: building a plan reads manifests and nothing else, so its time
depends on the number of shards, not on their bytes.

Measured, each the median of --repeats runs after one warm-up, in one process:
  index     read_corpus_index (the manifests parsed and checked)
  build     build_plan on that index (budgets, selection, phases, validation)
  plan      `ds-trhash data plan` through ds_trhash.cli.main: read + build + write + reload
  scored    the same with --quality-scores over all 1,000 shards
  correct   `ds-trhash data correct-plan` of the plan, swapping a few shards per source
and once, `ds-trhash data plan` as a fresh process (interpreter and imports included).

  .venv/bin/python bench/bench_plan.py [--shards 1000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the release-layout manifest writer of the tests (tests/data/release_corpus.py)

from ds_trhash.cli import main  # noqa: E402
from ds_trhash.data.plans.corpus_index import read_corpus_index  # noqa: E402
from ds_trhash.data.plans.build import build_plan, score_key  # noqa: E402
from tests.data.release_corpus import FULL_ROWS, write_release_layout  # noqa: E402

# The release's mixture, scaled to the requested shard count (shares of its unique-token budgets).
SHARES = {"dclm": 20, "fineweb_edu_dedup": 25, "stack_edu": 8, "finemath": 5, "infiwebmath": 5, "cosmopedia_v2": 7}
PASSES = {"dclm": 1, "fineweb_edu_dedup": 2, "stack_edu": 2, "finemath": 3, "infiwebmath": 3, "cosmopedia_v2": 2}
SEQ_LEN = 1024


def layout(shards: int) -> dict[str, list[int]]:
    total = sum(SHARES.values())
    counts = {s: max(2, shards * share // total) for s, share in SHARES.items()}
    counts["dclm"] += shards - sum(counts.values())
    return {s: [FULL_ROWS] * (n - 1) + [FULL_ROWS // 2] for s, n in counts.items()}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up (imports, file cache)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quiet_main(argv: list[str]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"ds-trhash {' '.join(argv)} exited {code}")


def run(shards: int, repeats: int, work: Path) -> dict:
    rows = layout(shards)
    corpus = write_release_layout(work / "corpus", rows, seq_len=SEQ_LEN)
    manifest_bytes = sum(p.stat().st_size for p in corpus.rglob("*.json"))
    # half of each source's tokens, so every source's selection spans hundreds of shards
    budgets = {s: sum(r) * SEQ_LEN // 2 for s, r in rows.items()}
    plan_args = ["data", "plan", "--manifest", str(corpus), "--source-tokens", *[f"{s}={b}" for s, b in budgets.items()],
                 "--passes", *[f"{s}={p}" for s, p in PASSES.items()], "--row-alignment", "512",
                 "--dataset", "hf://datasets/bench/corpus", "--revision", "main"]
    scores = {score_key(s, f"tokens-{i:05d}.bin"): (i * 7919 % 1000) / 1000 for s, r in rows.items() for i in range(len(r))}
    scores_path = work / "scores.json"
    scores_path.write_text(json.dumps(scores))
    outs = iter(range(10**6))

    def out() -> str:
        return str(work / "plans" / f"p{next(outs)}.json")

    index = read_corpus_index([corpus])
    plan_file = out()
    quiet_main([*plan_args, "--out", plan_file])
    counts = [f"{s}={3 if PASSES[s] > 1 else 0}" for s in rows]
    figures = {
        "index": median_time(lambda: read_corpus_index([corpus]), repeats),
        "build": median_time(lambda: build_plan(index, None, dataset="d", revision="r", source_budgets=budgets,
                                                source_passes=PASSES, row_alignment=512), repeats),
        "plan": median_time(lambda: quiet_main([*plan_args, "--out", out()]), repeats),
        "scored": median_time(lambda: quiet_main([*plan_args, "--quality-scores", str(scores_path), "--out", out()]),
                              repeats),
        "correct": median_time(lambda: quiet_main(["data", "correct-plan", plan_file, "--double-exposed", *counts,
                                                   "--manifest", str(corpus), "--out", out()]), repeats),
    }
    cli = shutil.which("ds-trhash", path=str(Path(sys.executable).parent)) or "ds-trhash"
    start = time.perf_counter()
    subprocess.run([cli, *plan_args, "--out", out()], check=True, capture_output=True, env=dict(os.environ))
    figures["process"] = time.perf_counter() - start
    doc = json.loads(Path(plan_file).read_text())
    selected = sum(len(e) for e in doc["phases"][0]["sources"].values())
    return {"shards": sum(len(r) for r in rows.values()), "sources": len(rows), "manifest_bytes": manifest_bytes,
            "corpus_tokens": sum(sum(r) for r in rows.values()) * SEQ_LEN, "core_shards": selected,
            "phases": len(doc["phases"]), "trained_tokens": doc["trained_tokens"], **figures}


def main_cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_plan_") as tmp:
        r = run(args.shards, args.repeats, Path(tmp))
    print(f"corpus: {r['shards']} shards over {r['sources']} sources, {r['corpus_tokens']:,} tokens "
          f"(~{r['corpus_tokens'] * 2 / 1e12:.2f} TB of shards, none present); manifests {r['manifest_bytes']:,} bytes")
    print(f"plan: {r['core_shards']} unique-core shard entries, {r['phases']} phases, "
          f"{r['trained_tokens']:,} trained tokens")
    print(f"median of {args.repeats} (seconds):")
    for key, what in (("index", "read the corpus index"), ("build", "build_plan"),
                      ("plan", "data plan (in process)"), ("scored", "data plan --quality-scores"),
                      ("correct", "data correct-plan")):
        print(f"  {what:<28} {r[key]:.4f}")
    print(f"once: data plan as a new process  {r['process']:.2f} (interpreter and imports included)")


if __name__ == "__main__":
    main_cli()
