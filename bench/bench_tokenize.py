"""Tokens per second of `data tokenize` with 1 and N workers against the tokenizers library (not a test).

    .venv/bin/python bench/bench_tokenize.py [--mb 8] [--vocab-size 8192] [--workers N] [--tokenizer DIR]

One run, one corpus: JSONL documents (paragraphs of the standard library's pydoc topics, varied
by a counter so no two are equal) of about ``--mb`` MB, and a byte-level BPE (trained on that
text unless ``--tokenizer`` names one). Measured, in this order:

* ``data tokenize`` (``run_tokenize``, in this process: console-script start-up excluded) with
  1 worker and with N workers (default: every core), wall time from the first record read to the
  manifest written (reading, decoding, encoding, chunk store, shards, manifest);
* the tokenizers library on the same texts in this one process: ``encode`` per document on one
  thread (the single-process figure the goal multiplies), and ``encode_batch`` with the library's
  own thread pool.

Prints tokens/s of each and the parallel efficiency: tokens/s(N workers) / (N × single-thread
``encode``); the goal is ≥ 0.9 within what the machine's cores allow.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pydoc_data.topics import topics

from ds_trhash.data.inputs import file_inputs
from ds_trhash.data.parallel_tokenize import TokenizeJob, default_workers, run_tokenize
from ds_trhash.data.tokenizer import load_tokenizer, train_tokenizer


def corpus(path: Path, megabytes: float) -> list[str]:
    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 40]
    docs, size, i = [], 0, 0
    while size < megabytes * 1e6:
        doc = f"{i}. " + " ".join(paragraphs[(i * 7 + k) % len(paragraphs)] for k in range(1 + i % 5))
        docs.append(doc)
        size += len(doc.encode())
        i += 1
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return docs


def time_tokenize(data: Path, tok: Path, out: Path, workers: int) -> tuple[float, int]:
    job = TokenizeJob("bench", file_inputs([data]), tok, seq_len=1024, rows_per_shard=4096, out=out,
                      vocab_size=65536, workers=workers)
    start = time.perf_counter()
    manifest = run_tokenize(job, log=lambda _: None)["manifest"]
    return time.perf_counter() - start, manifest["stream_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="corpus size in MB of text")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", type=Path, help="an existing tokenizer directory (default: train one)")
    parser.add_argument("--workers", type=int, default=default_workers())
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_tokenize_"))
    try:
        data = work / "docs.jsonl"
        docs = corpus(data, args.mb)
        tok = args.tokenizer or train_tokenizer(docs[:2000], args.vocab_size, work / "tok").parent
        print(f"corpus: {len(docs)} documents, {data.stat().st_size / 1e6:.1f} MB JSONL; "
              f"{os.cpu_count()} cores; tokenizer {tok}")
        rows = []
        for workers in sorted({1, args.workers}):
            wall, tokens = time_tokenize(data, tok, work / f"out-{workers}", workers)
            rows.append((f"data tokenize --workers {workers}", tokens, wall))
        tokenizer = load_tokenizer(tok)
        start = time.perf_counter()
        single = sum(len(tokenizer.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
        rows.append(("tokenizers encode, 1 thread", single, time.perf_counter() - start))
        start = time.perf_counter()
        batch = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(docs, add_special_tokens=False))
        rows.append(("tokenizers encode_batch, its threads", batch, time.perf_counter() - start))
        assert rows[0][1] == single == batch, "every path must produce the same token count"
        print(f"{'path':40s} {'tokens':>12s} {'seconds':>9s} {'tokens/s':>12s}")
        for name, tokens, wall in rows:
            print(f"{name:40s} {tokens:12d} {wall:9.2f} {tokens / wall:12.0f}")
        base = single / rows[-2][2]
        best = rows[len(rows) - 3]
        n = args.workers
        print(f"efficiency of {n} workers: {best[1] / best[2] / (n * base):.2f} of {n} × single-thread encode "
              f"(goal ≥ 0.90); 1 worker: {rows[0][1] / rows[0][2] / base:.2f} of single-thread encode")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
