"""Hub egress and requests of a streamed job by node count (not a test), and the projection to the
release's plan.

    .venv/bin/python bench/bench_egress.py [--shards 40] [--rows 2048] [--seq-len 128] [--nodes 1 2 4]
                                           [--repeat 3] [--plan ../shared/release-plans/tr_hash_70b_quality_replay.json]

1. A synthetic corpus (two sources, ``--shards`` shards of ``--rows`` rows each) is served by the
   loopback Hub stand-in (``tests/release/hub_server.py``, the real ``huggingface_hub`` client) from
   a process of its own, and read to its end by a plain reader from local disk (rows/s), straight and through a cold node cache filled from that disk.
2. For each node count N, a fresh Hub serves it to N processes, one per simulated node: each is one
   rank of a world of N (its rows of every step, micro-batches of 8) with a node cache of its own;
   as in a multi-node launch, each node fills only the shards it owns and the rows travel between
   the nodes over gloo (``data.stream.delivery.exchange``). Printed: the rows/s of the slowest node (times N) against the same N
   node processes reading the plan from local disk (each node cache filled from the directory),
   run just before and just after it (the machine's speed drifts by a third within seconds: the
   figure is the median of the rounds' ratios to the mean of those two; N readers on two cores
   are short of CPU whatever they read from), the bytes of rows sent between nodes, the shard
   bytes the Hub served against the corpus bytes the plan reads (egress), every request the
   Hub answered, by kind, and where a job's CPU went (the readers, their prefetch processes, the
   loopback Hub's process) against its wall time, streamed and local: on a machine with fewer
   cores than the job has processes, the rate ratio is about the ratio of those CPU seconds.
   Goals: streamed at least 0.95x local, egress at most 1.05x.
3. The projection: the requests of one shard download and of one node's start, measured in 2.,
   applied to ``--plan``: shard downloads per pass (every planned shard entry once per pass of
   its phase; a cache smaller than the corpus fetches each again in each pass), bytes, and
   requests per 5 minutes at the speed goal (786,432 tokens per 0.33 s per 8-GPU node), against
   the Hub's resolver limits per 5 minutes (anonymous 3,000, free 5,000, PRO 12,000).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_stream import GOAL_TOKENS_PER_S, TOKEN, cached_pass, corpus, cpu_s, hub_process, rows_per_s  # noqa: E402
from ds_trhash.batch_layout import BatchLayout  # noqa: E402
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.delivery import ReplayReader, RowExchange
from ds_trhash.data.stream.store import HubStore  # noqa: E402
from tests.data.hub_corpus import corpus_files  # noqa: E402

HUB_REPO = "bench/egress"
MICRO = 8
LIMITS = {"anonymous": 3_000, "free": 5_000, "PRO": 12_000}  # resolver requests per 5 minutes


def _node(plan: dict, node: int, nodes: int, tmp: Path, out, local: Optional[Path] = None) -> None:
    """One simulated node: rank ``node`` of ``nodes``, its own cache, fed from the Hub with the
    shards it owns, the rest of its rows from their owners (``exchange``), or (``local``: the
    reference) every shard it reads filled from that directory."""
    shared = local is None and nodes > 1
    if local is not None:
        corpus_ = open_corpus(plan, str(local))
    else:
        corpus_ = open_corpus(plan, None, store=HubStore(HUB_REPO))
    if shared:
        tmp.mkdir(parents=True, exist_ok=True)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=node, world_size=nodes)
    rows = sum(e["rows"] for ph in plan["phases"] for es in ph["sources"].values() for e in es)
    layout = BatchLayout(micro_batch=MICRO, grad_accum=1, rank=node, world_size=nodes)
    steps = rows // layout.global_batch
    with corpus_.open_cache(tmp / f"cache-{node}", 2**40, fetch_process=True) as cache:
        reader = ReplayReader(plan, None, 0, cache=cache)
        exchange = RowExchange(reader, layout, node, nodes) if shared else None
        cache.prefetch([])  # the prefetch process starts, as at a stage's start
        cache.wait_idle()
        helpers = [p.pid for p in psutil.Process().children(recursive=True)]  # the prefetch process
        cpu = time.process_time(), sum(cpu_s(pid) for pid in helpers)
        started = time.perf_counter()
        for step in range(steps):
            if exchange is not None:
                exchange.get(step)
            else:
                reader.batch(step, 0, layout)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu[0], sum(cpu_s(pid) for pid in helpers) - cpu[1]
        sent = 0
        if exchange is not None:
            sent = exchange.sent_bytes
            exchange.close()
        reader.close()
        cache.wait_idle()  # the prefetch process's last answers (its counts) read
        waited = cache.stats()["waited_s"]
    if shared:
        dist.destroy_process_group()
    out.put((node, steps * MICRO / elapsed, sent, waited, {"wall": elapsed, "reader": cpu[0], "prefetch": cpu[1]}))


def _run_nodes(plan: dict, nodes: int, tmp: Path, local: Optional[Path] = None) -> list[tuple]:
    """(node, rows/s, bytes of rows it sent to other nodes, seconds its reads waited for shards,
    its wall and CPU seconds) of each of ``nodes`` node processes reading the plan at once. Their
    caches are deleted after them: left on disk, the kernel wrote them back during later rounds
    (the dirty pages expire after 30 s), and those rounds read slower, streamed or local."""
    return _deleted_after(tmp, lambda folder: _run_node_processes(plan, nodes, folder, local))


def _run_node_processes(plan: dict, nodes: int, tmp: Path, local: Optional[Path]) -> list[tuple]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_node, args=(plan, i, nodes, tmp, results, local)) for i in range(nodes)]
    for p in procs:
        p.start()
    found = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"node process exited {p.exitcode}")
    return sorted(found)


def job(plan: dict, root: Path, nodes: int, tmp: Path) -> dict:
    """One streamed read of the whole plan by ``nodes`` simulated nodes: their rows/s, the Hub's
    counts (requests by kind, complete GETs by path)."""
    with hub_process({HUB_REPO: root}) as hub:
        os.environ.update(HF_ENDPOINT=hub["url"], HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1")
        served_cpu = cpu_s(hub["pid"])
        found = _run_nodes(plan, nodes, tmp / f"job-{nodes}")
        served_cpu = cpu_s(hub["pid"]) - served_cpu
    return {"rates": [r for _, r, *_ in found], "sent": sum(c for _, _, c, *_ in found),
            "waited": max(w for *_, w, _ in found), "cpu": _cpu(found, served_cpu),
            "counts": hub["counts"], "served": hub["served"]}


def _deleted_after(folder: Path, run):
    """``run(folder)``, then the folder deleted and what is left written out (``_run_nodes``):
    each job starts with no dirty page on the disk."""
    try:
        return run(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.sync()


def _cpu(found: list[tuple], hub_s: float = 0.0) -> dict:
    """A job's seconds: its wall time (the slowest node) and the CPU of its readers, their
    prefetch processes and the Hub (the loopback Hub's own process; none for a local job)."""
    times = [t for *_, t in found]
    return {"wall": max(t["wall"] for t in times), "reader": sum(t["reader"] for t in times),
            "prefetch": sum(t["prefetch"] for t in times), "hub": hub_s}


def local_job(plan: dict, root: Path, nodes: int, tmp: Path) -> tuple[float, dict]:
    """The same read by ``nodes`` node processes from the local directory (each node cache filled
    from disk with every shard it reads, no Hub, no exchange): the job's rows/s, set by its slowest node, and its seconds."""
    found = _run_nodes(plan, nodes, tmp, local=root)
    return min(r for _, r, *_ in found) * nodes, _cpu(found)


def _seconds(kind: str, jobs: list[dict]) -> str:
    """The median job's seconds, by part: where a job's CPU went, against its wall time."""
    part = {name: statistics.median(j[name] for j in jobs) for name in ("wall", "reader", "prefetch", "hub")}
    total = part["reader"] + part["prefetch"] + part["hub"]
    hub = f" + Hub {part['hub']:.2f}" if part["hub"] else ""
    return (f"{kind}: {part['wall']:.2f} s, CPU {total:.2f} s = readers {part['reader']:.2f} + prefetch "
            f"processes {part['prefetch']:.2f}{hub}")


def _shard_reads(plan: dict) -> tuple[int, int]:
    """(shard downloads per pass of the plan, their bytes): every shard entry once per pass."""
    count = size = 0
    for phase in plan["phases"]:
        for entries in phase["sources"].values():
            count += len(entries) * int(phase["passes"])
            size += sum((int(e["rows"]) * int(plan["seq_len"]) + 1) * 2 for e in entries) * int(phase["passes"])
    return count, size


def projection(plan_path: Path, per_shard: float, per_start: float, node_counts: list[int]) -> None:
    plan = json.loads(plan_path.read_text())
    downloads, size = _shard_reads(plan)
    tokens = int(plan["trained_tokens"])
    print(f"projection to {plan_path.name}: {downloads} shard downloads, {size / 1e9:,.0f} GB, "
          f"{tokens / 1e9:,.0f}B trained tokens per pass")
    for nodes in node_counts:
        seconds = tokens / (GOAL_TOKENS_PER_S * nodes)
        requests = downloads * per_shard + nodes * per_start
        per_5 = requests / seconds * 300
        print(f"  {nodes} node(s) x 8 GPUs: pass {seconds / 3600:,.1f} h; Hub egress {size / 1e9:,.0f} GB for the job "
              f"(each node downloading alone: {nodes * size / 1e9:,.0f} GB); {requests:,.0f} requests per pass, "
              f"{per_5:,.1f} per 5 minutes ({', '.join(f'{k} {v:,}' for k, v in LIMITS.items())})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=40)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of each read; the medians are printed")
    ap.add_argument("--plan", type=Path, default=REPO.parent / "shared" / "release-plans" /
                    "tr_hash_70b_quality_replay.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        root = tmp / "corpus"
        plan = corpus(root, args.shards, args.rows, args.seq_len)
        plan["dataset"] = f"hf://datasets/{HUB_REPO}"
        bins = {p: len(b) for p, b in corpus_files(root).items() if p.endswith(".bin")}
        os.sync()  # the corpus on disk before anything is timed (see _run_nodes)
        rows = sum(e["rows"] for ph in plan["phases"] for es in ph["sources"].values() for e in es)
        direct = statistics.median(rows_per_s(ReplayReader(plan, root, 0), rows) for _ in range(args.repeat))
        local = statistics.median(_deleted_after(tmp / f"cache-local-{i}", lambda d: cached_pass(
            plan, open_corpus(plan, str(root)), d, rows)[0]) for i in range(args.repeat))
        print(f"corpus: {rows:,} rows of {args.seq_len} tokens, {len(bins)} shards, {sum(bins.values()) / 2**20:.1f} MiB; "
              f"read from local disk: {direct:,.0f} rows/s straight, {local:,.0f} rows/s through a cold node cache "
              "(one process)")
        per_shard = per_start = 0.0
        for nodes in args.nodes:
            rounds, ratios, locals_ = [], [], []
            before, seconds = local_job(plan, root, nodes, tmp / f"local-{nodes}-first")
            locals_.append(seconds)
            for i in range(args.repeat):  # the speed drifts: each streamed job against the local jobs on either side
                rounds.append(job(plan, root, nodes, tmp / f"round-{nodes}-{i}"))
                after, seconds = local_job(plan, root, nodes, tmp / f"local-{nodes}-{i}")
                locals_.append(seconds)
                ratios.append(min(rounds[-1]["rates"]) * nodes / ((before + after) / 2))
                before = after
            found = rounds[-1]  # the counts are the same in every round; the rate is the median
            found["rates"] = [statistics.median(r["rates"][i] for r in rounds) for i in range(nodes)]
            ratio = statistics.median(ratios)
            waited = statistics.median(r["waited"] for r in rounds)
            served = sum(n * bins[p] for p, n in found["served"].items()
                         if p.endswith(".bin"))
            shard_gets = sum(n for p, n in found["served"].items() if p.endswith(".bin"))
            requests = sum(found["counts"].values())
            slowest = min(found["rates"]) * nodes  # the job's rows/s is set by its slowest node
            print(f"{nodes} node(s): streamed {slowest:,.0f} rows/s for the job = {ratio:.3f} of the same {nodes} node(s) "
                  f"reading from local disk just before and after, median of {args.repeat} rounds' ratios "
                  f"({', '.join(f'{r:.2f}' for r in ratios)}; goal 0.95: {'met' if ratio >= 0.95 else 'NOT met'}); Hub egress {served / 2**20:.1f} MiB "
                  f"= {served / sum(bins.values()):.3f} x the corpus read (goal <= 1.05: "
                  f"{'met' if served <= 1.05 * sum(bins.values()) else 'NOT met'}); {shard_gets} shard GETs, "
                  f"{found['sent'] / 2**20:.1f} MiB of rows sent between nodes; reads waited {waited:.2f} s for shards (the node that waited most); "
                  f"{requests} requests: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(found["counts"].items())))
            print("   " + _seconds("streamed", [r["cpu"] for r in rounds]) + "; " + _seconds("local", locals_)
                  + f" ({os.cpu_count()} cores)")
            manifests = len({s for phase in plan["phases"] for s in phase["sources"]})  # read once per node
            shard_requests = found["counts"].get("resolve", 0) - nodes * manifests
            per_shard = max(per_shard, shard_requests / max(1, shard_gets))
            per_start = max(per_start, (requests - shard_requests) / nodes)
        print(f"measured: {per_shard:.2f} requests per shard download, {per_start:.1f} per node start")
        if args.plan.is_file():
            projection(args.plan, per_shard, per_start, args.nodes)


if __name__ == "__main__":
    main()
