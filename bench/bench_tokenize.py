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

Prints tokens/s (wall) and tokens per CPU-second of each, and the parallel efficiency:
tokens/s(N workers) / (N × single-thread ``encode``); the goal is ≥ 0.9 within what the machine's
cores allow. On a loaded machine the wall figures say little; CPU seconds per token against bare
``encode`` show what the pipeline itself costs, whatever the load.
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

from ds_trhash.data.build.inputs import file_inputs
from ds_trhash.data.build.tokenize import TokenizeJob, default_workers, run_tokenize
from ds_trhash.data.formats.tokenizer import load_tokenizer, train_tokenizer


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


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the tokenize workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(name: str, run) -> tuple[str, int, float, float]:
    """(name, tokens, wall seconds, CPU seconds) of ``run()``, which returns its token count."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokens = run()
    return name, tokens, time.perf_counter() - wall, cpu_seconds() - cpu


def tokenize_run(data: Path, tok: Path, out: Path, workers: int):
    job = TokenizeJob("bench", file_inputs([data]), tok, seq_len=1024, rows_per_shard=4096, out=out,
                      vocab_size=65536, workers=workers)
    return lambda: run_tokenize(job, log=lambda _: None)["manifest"]["stream_tokens"]


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
        n = args.workers
        rows = [measure(f"data tokenize --workers {w}", tokenize_run(data, tok, work / f"out-{w}", w))
                for w in sorted({1, n})]
        tokenizer = load_tokenizer(tok)
        rows.append(measure("tokenizers encode, 1 thread", lambda: sum(
            len(tokenizer.encode(d, add_special_tokens=False).ids) + 1 for d in docs)))
        rows.append(measure("tokenizers encode_batch, its threads", lambda: sum(
            len(e.ids) + 1 for e in tokenizer.encode_batch(docs, add_special_tokens=False))))
        assert len({r[1] for r in rows}) == 1, "every path must produce the same token count"
        print(f"{'path':38s} {'tokens':>10s} {'wall s':>7s} {'tokens/s':>10s} {'CPU s':>7s} {'tokens/CPU-s':>12s}")
        for name, tokens, wall, cpu in rows:
            print(f"{name:38s} {tokens:10d} {wall:7.2f} {tokens / wall:10.0f} {cpu:7.2f} {tokens / cpu:12.0f}")
        single = rows[-2][1] / rows[-2][2]
        one, many = rows[0], rows[-3]
        print(f"{n} workers: {many[1] / many[2] / (n * single):.2f} of {n} x single-thread encode (goal >= 0.90); "
              f"1 worker: {one[1] / one[2] / single:.2f}; CPU per token against bare encode: "
              f"{one[3] / rows[-2][3]:.2f} (1 worker), {many[3] / rows[-2][3]:.2f} ({n} workers); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
