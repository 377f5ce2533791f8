"""Shard streaming figures (not a test): rows/s delivered from the loopback Hub against local disk,
and the launch's data check over a 1,000-shard corpus before and after the store.

    .venv/bin/python bench/bench_stream.py [--shards 40] [--rows 2048] [--seq-len 128] [--check-shards 1000] [--repeat 3]

1. A synthetic corpus (two sources, ``--shards`` shards of ``--rows`` rows each) is written once,
   served by the loopback Hub stand-in (``tests/release/hub_server.py``, the real
   ``huggingface_hub`` client) and read in plan order, micro-batches of 8 rows, by one reader:
   straight from the directory (no cache), through the node cache filled from the directory, and
   through the node cache filled from the Hub (cold: every shard downloaded on the way, prefetched
   by the reader's prefetch process as in training, ``data/stream/cache/fetcher.py``), and through a
   warm node cache (every shard already in it and verified, as a
   resumed run or a second stage finds it), and through a cold node cache that another process
   fills in plan order while the reader runs no prefetch thread (the fill's interpreter work off
   the reading process, as another rank of the node would do it). The server runs in a process of
   its own (a first version served from the reader's process, whose serving threads then competed
   with the reader for one interpreter), on this machine's two cores all the same; the client
   side, the downloads and the hashing, runs beside the reader, as in training.
   The four cached passes run ``--repeat`` rounds, each round in a rotated order, with a direct
   pass before each and after the last, and the medians are printed: run one after the other
   once, the pass that ran under the heaviest load (or first, before the page cache was warm)
   decided the comparison. This machine's speed drifts by a third within seconds, so each cold
   pass is compared with the direct passes on either side of it, and the warm pass with a direct
   reader taking turns with it micro-batch by micro-batch; the median of those ratios is printed.
   The goals: the cold cache at least 0.8 of direct reads, the warm one at least 0.95, the Hub
   at least 0.95 of the cache filled from disk. Last, the CPU time the cold passes' fills took
   per MiB (the prefetch process's, and the Hub stand-in's), and what that is at the speed goal.
2. The launch's data check for a plan over a ``--check-shards``-shard corpus: before (every planned
   shard hashed, as the launch did) and after (one listing and the manifests), from the directory
   and from the Hub, at two shard sizes: the "after" time should not grow with the corpus bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_trhash.batch_layout import BatchLayout  # noqa: E402
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.plans.build import build_plan  # noqa: E402
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.data.formats.shards import load_manifests, write_shards  # noqa: E402
from ds_trhash.data.stream.store import HubStore  # noqa: E402
from tests.data.hub_corpus import corpus_files  # noqa: E402
from tests.release.hub_server import HubServer, seed_dataset  # noqa: E402

TOKEN = "hf_benchstreamtoken"


def corpus(root: Path, shards: int, rows: int, seq_len: int) -> dict:
    rng = np.random.default_rng(0)
    for source in ("a", "b"):
        stream = rng.integers(1, 30000, shards * rows * seq_len + 1)
        write_shards(source, [stream], seq_len, rows, root, vocab_size=32000, tokenizer_hash="h")
    manifests = load_manifests([root])
    total = sum(m["total_rows"] for m in manifests.values()) * seq_len
    return build_plan(manifests, total, dataset="hf://datasets/bench/corpus", revision="main")


def rows_per_s(reader: ReplayReader, rows: int, micro: int = 8) -> float:
    layout = BatchLayout(micro_batch=micro, grad_accum=1, rank=0, world_size=1)
    started = time.perf_counter()
    for step in range(rows // micro):
        reader.batch(step, 0, layout)
    return (rows // micro * micro) / (time.perf_counter() - started)


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def cached_pass(plan: dict, corpus, cache_dir: Path, n: int) -> tuple[float, float, float]:
    """Rows/s through the node cache in ``cache_dir`` (cold when the folder is new), the seconds
    the reads waited for downloads, and the CPU seconds the prefetch process spent meanwhile."""
    with corpus.open_cache(cache_dir, 2**40, fetch_process=True) as cache:
        cache.prefetch([])  # the prefetch process starts (an interpreter, its imports), as at a stage's start
        cache.wait_idle()
        started = cpu_s(cache.prefetch_pid)
        rate = rows_per_s(ReplayReader(plan, None, 0, cache=cache), n)
        cache.wait_idle()
        return rate, cache.stats()["waited_s"], cpu_s(cache.prefetch_pid) - started


def warm_beside_direct(plan: dict, root: Path, cache_dir: Path, n: int) -> tuple[float, float]:
    """(rows/s through the warm node cache, its ratio to direct reads), the two readers taking
    turns micro-batch by micro-batch, each timed on its own: the machine's speed, which drifts
    within a second here, is then the same for both. Only for a warm cache: in a cold pass the
    fill runs beside the reader, and taking turns would give it twice the time and slow the
    direct reads with it."""
    with open_corpus(plan, str(root)).open_cache(cache_dir, 2**40, fetch_process=True) as cache:
        cache.prefetch([])
        cache.wait_idle()
        readers = (ReplayReader(plan, root, 0), ReplayReader(plan, None, 0, cache=cache))
        spent, layout = [0.0, 0.0], BatchLayout(micro_batch=8, grad_accum=1, rank=0, world_size=1)
        for step in range(n // 8):
            for which in (0, 1) if step % 2 else (1, 0):  # neither always goes first
                started = time.perf_counter()
                readers[which].batch(step, 0, layout)
                spent[which] += time.perf_counter() - started
    return n // 8 * 8 / spent[1], spent[0] / spent[1]


def _fill_in_order(plan: dict, root: Path, cache_dir: Path, keys: list) -> None:
    """Another process of the node fetching the plan's shards into the cache, in first-read order."""
    with open_corpus(plan, str(root)).open_cache(cache_dir, 2**40, prefetch=0) as cache:
        for key in keys:
            cache.get(*key)


def other_process_pass(plan: dict, root: Path, cache_dir: Path, n: int) -> tuple[float, None]:
    """Rows/s through a cold node cache that another process fills (as another rank of the node
    would) while this one reads with no prefetch thread: the fill's interpreter work off the
    reading process."""
    keys = list(dict.fromkeys((s, f) for s, f, _ in ReplayReader(plan, root, 0).global_rows(0, n)))
    filler = mp.get_context("fork").Process(target=_fill_in_order, args=(plan, root, cache_dir, keys), daemon=True)
    filler.start()
    try:
        with open_corpus(plan, str(root)).open_cache(cache_dir, 2**40, prefetch=0) as cache:
            return rows_per_s(ReplayReader(plan, None, 0, cache=cache), n), None
    finally:
        filler.join(60)


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@contextlib.contextmanager
def hub_process(repos: dict[str, Path]):
    """The loopback Hub serving ``repos`` (repository id -> corpus folder) from a process of its
    own, as a real Hub is not in the reader's interpreter; the client side (downloads, hashing)
    stays in this process, as in training. Yields a dict with its ``url``; once the block ends it
    also holds what the Hub answered after seeding: ``counts`` (requests by endpoint) and
    ``served`` (complete GETs by repository path)."""
    ours, theirs = mp.get_context("fork").Pipe()
    server = mp.get_context("fork").Process(target=_serve_hub, args=(theirs, repos), daemon=True)
    server.start()
    hub = {"url": ours.recv(), "pid": server.pid}
    try:
        yield hub
    finally:
        ours.send("stop")
        hub.update(ours.recv())
        server.join(30)


def _serve_hub(conn, repos: dict[str, Path]) -> None:
    with HubServer(TOKEN, deadline_s=3600) as hub:
        for repo, root in repos.items():
            seed_dataset(hub, repo, corpus_files(root))
        hub.counts.clear()
        hub.served.clear()
        conn.send(hub.url)
        conn.recv()
        conn.send({"counts": dict(hub.counts), "served": dict(hub.served)})


GOAL_TOKENS_PER_S = 786_432 / 0.33  # one 8-GPU node at the speed goal
GOAL_MIB_PER_S = GOAL_TOKENS_PER_S * 2 / 2**20  # its token bytes (uint16)


def hub_pass(plan: dict, cache_dir: Path, n: int, server: int) -> tuple[float, float, float, float]:
    """``cached_pass`` from the loopback Hub, and the CPU seconds its server spent meanwhile."""
    started = cpu_s(server)
    found = cached_pass(plan, open_corpus(plan, None, store=HubStore("bench/corpus")), cache_dir, n)
    return (*found, cpu_s(server) - started)


def read_passes(plan: dict, root: Path, tmp: Path, n: int, repeat: int, server: int, mib: float) -> None:
    """The four cached passes, ``repeat`` rounds, each round in a rotated order, with a direct
    pass before the first and after each: every cold pass is compared with the direct passes on
    either side of it (the machine's speed drifts over tens of seconds; a direct pass five passes
    away said more about the drift than about the cache), the warm one with a direct reader
    taking turns with it (``warm_beside_direct``). The medians of those ratios, and the CPU time
    the cold passes' fills took per MiB (the prefetch process; for the Hub also its server)."""
    warm_dir = tmp / "cache-warm"
    cached_pass(plan, open_corpus(plan, str(root)), warm_dir, n)  # filled once, read again by every round
    direct = lambda: rows_per_s(ReplayReader(plan, root, 0), n)  # noqa: E731
    # each: (rows/s, the Hub pass's wait for downloads or the warm pass's own ratio, CPU seconds of the fill...)
    passes = {"local": lambda i: cached_pass(plan, open_corpus(plan, str(root)), tmp / f"cache-local-{i}", n),
              "hub": lambda i: hub_pass(plan, tmp / f"cache-hub-{i}", n, server),
              "warm": lambda i: warm_beside_direct(plan, root, warm_dir, n),
              "other": lambda i: (*other_process_pass(plan, root, tmp / f"cache-other-{i}", n),)}
    fill_cpu: dict[str, list[tuple[float, ...]]] = {"local": [], "hub": []}
    rates: dict[str, list[float]] = {name: [] for name in ("direct", *passes)}
    of_direct: dict[str, list[float]] = {name: [] for name in passes}  # each pass / the direct ones around it
    waited = []
    names = list(passes)
    for i in range(repeat):  # each round in another order: no pass always runs first or last
        before = direct()
        rates["direct"].append(before)
        for name in names[i % len(names):] + names[: i % len(names)]:
            rate, extra, *cpu = passes[name](i)
            if name in fill_cpu:
                fill_cpu[name].append(tuple(cpu))
            after = direct()
            rates[name].append(rate)
            rates["direct"].append(after)
            of_direct[name].append(extra if name == "warm" else rate / ((before + after) / 2))
            before = after
            if name == "hub":
                waited.append(extra)
    median = {name: statistics.median(values) for name, values in rates.items()}
    ratio = {name: statistics.median(values) for name, values in of_direct.items()}
    ratio["hub/local"] = statistics.median(h / loc for h, loc in zip(of_direct["hub"], of_direct["local"]))
    print(f"read passes: {repeat} rounds of (local cache, Hub cache, warm cache, cache filled by another process), "
          "rotated, a direct pass before each and after the last; rows/s: medians; against: the median of each "
          "pass's ratio to the direct passes on either side of it (the warm cache: to a direct reader taking turns "
          "with it micro-batch by micro-batch)")
    print(f"rows/s  local dir, no cache: {median['direct']:,.0f}")
    print(f"rows/s  node cache from the local dir (cold): {median['local']:,.0f} = {ratio['local']:.3f} of direct "
          f"reads (goal 0.8: {'met' if ratio['local'] >= 0.8 else 'NOT met'})")
    print(f"rows/s  node cache from the loopback Hub (cold): {median['hub']:,.0f} = {ratio['hub/local']:.3f} of the "
          f"local cache (goal 0.95: {'met' if ratio['hub/local'] >= 0.95 else 'NOT met'}), "
          f"{ratio['hub']:.3f} of direct reads; reads waited {statistics.median(waited):.2f} s for downloads")
    print(f"rows/s  node cache, warm (every shard verified in it): {median['warm']:,.0f} = {ratio['warm']:.3f} of "
          f"direct reads (goal 0.95: {'met' if ratio['warm'] >= 0.95 else 'NOT met'})")
    print(f"rows/s  node cache from the local dir (cold), filled by another process, no prefetch process: "
          f"{median['other']:,.0f} = {ratio['other']:.3f} of direct reads (the whole fill done before the reader needs it)")
    local_ms = 1000 * statistics.median(c[0] for c in fill_cpu["local"]) / mib
    worker_ms, server_ms = (1000 * statistics.median(c[k] for c in fill_cpu["hub"]) / mib for k in (0, 1))
    print(f"fill CPU per MiB of shards (medians): from the local dir {local_ms:.2f} ms (the prefetch process); from "
          f"the Hub {worker_ms:.2f} ms (the prefetch process) + {server_ms:.2f} ms (the stand-in server). At the "
          f"speed goal an 8-GPU node reads {GOAL_MIB_PER_S:.2f} MiB/s of tokens: a Hub fill then takes "
          f"{worker_ms * GOAL_MIB_PER_S / 10:.1f} % of one core per node (these passes read "
          f"{median['direct'] * mib / n:.1f} MiB/s, filling at {worker_ms * median['direct'] * mib / n / 10:.0f} % "
          "of a core beside a reader that takes one of this machine's two)")
    for name, values in rates.items():
        print(f"  {name:6s} per pass: " + ", ".join(f"{r:,.0f}" for r in values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--check-shards", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the four cached passes, each in another order")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        root = tmp / "corpus"
        plan = corpus(root, args.shards, args.rows, args.seq_len)
        checks = {rows: corpus(tmp / f"check-{rows}", args.check_shards // 2, rows, args.seq_len) for rows in (16, 256)}
        repos = {"bench/corpus": root, **{f"bench/check-{rows}": tmp / f"check-{rows}" for rows in checks}}
        with hub_process(repos) as hub:
            os.environ.update(HF_ENDPOINT=hub["url"], HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1")
            n = sum(e["rows"] for ph in plan["phases"] for es in ph["sources"].values() for e in es)
            size = sum(len(b) for b in corpus_files(root).values())
            print(f"corpus: {n:,} rows of {args.seq_len} tokens, {2 * args.shards} shards, {size / 2**20:.1f} MiB")
            read_passes(plan, root, tmp, n, args.repeat, hub["pid"], size / 2**20)
            for rows, doc in checks.items():
                big = tmp / f"check-{rows}"
                mib = sum(p.stat().st_size for p in big.rglob("*.bin")) / 2**20
                before = timed(lambda: open_corpus(doc, str(big), deep=True))
                after = timed(lambda: open_corpus(doc, str(big)))
                hub_after = timed(lambda: open_corpus(doc, None, store=HubStore(f"bench/check-{rows}")))
                print(f"launch check, {args.check_shards} shards, {mib:.0f} MiB: before (hash every shard) {before:.3f} s; "
                      f"after, directory {after:.3f} s; after, loopback Hub {hub_after:.3f} s")


if __name__ == "__main__":
    main()
