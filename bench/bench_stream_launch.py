"""Data wait in a tiny 2-rank launch (not a test): the share of step time each launch spends
reading its batches, streamed from the loopback Hub against the same plan read from local disk.

    .venv/bin/python bench/bench_stream_launch.py [--steps 30] [--repeat 2] [--nodes 2 [--exchange-rows 64]]

The tiny pretraining config on the embedded demo corpus (built once), 2 CPU ranks through the
`deepspeed` launcher, no checkpoints until the last step. Each launch prints at the end of its
stage, on rank 0, ``data wait on rank 0: W s of S s in N step(s) (P %) waiting for batches;
assembling them took A s in the background: R s reading rows (..), H s waiting for shards (..)``
(docs/operations.md): P is the data wait share, the part of step time the training thread
waited for its batches; A = R + H is what reading cost off the step's path (A / S is what the
share would be if the batches were read inside the step). This script runs the local and the
Hub launch ``--repeat`` times each, alternating (local, hub, local, hub...) so that the machine's
load at one moment does not decide the comparison, and prints every launch's line and the medians.
Every launch starts with an empty node cache of its own (``data.cache_dir`` in the run's temporary
folder, not the user's default cache, which a former version of this script shared between its
launches): the Hub run downloads every shard during the run, with prefetch, which is the cold
worst case; the server runs in this script's process. With ``--nodes 2`` the Hub launch runs as two
simulated nodes of one rank each (two launchers, ``--no_ssh``, each node its own cache): each node
fills the shards it owns and the rows travel between them, ``--exchange-rows`` global rows at a time
(``data.exchange_rows``; the tiny config's steps are 8 rows); the line is node 0's.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_trhash.data.embedded import build_embedded  # noqa: E402
from tests.data.hub_corpus import corpus_files  # noqa: E402
from tests.release.hub_server import HubServer, seed_dataset  # noqa: E402
from tests.training import launch_utils as L  # noqa: E402

TOKEN = "hf_benchstreamlaunchtoken"
HUB_REPO = "bench/embedded"
LINE = re.compile(r"data wait on rank 0: ([\d.]+) s of ([\d.]+) s in (\d+) step\(s\) \(([\d.]+) %\) waiting for "
                  r"batches; assembling them took ([\d.]+) s [^:]*: ([\d.]+) s reading rows \([\d.]+ %\), ([\d.]+) s "
                  r"waiting for shards[^\n]*")


def launch(out: Path, steps: int, extra: list[str], nodes: int = 1, **env: str) -> tuple[float, float, str]:
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(steps),
            "--set", f"training.max_steps={steps}", "--set", "training.log_every=10", "--set", "checkpoint.packs=null",
            "--set", f"checkpoint.every_steps={steps}", "--set", "checkpoint.keep_last=null", *extra]
    if nodes == 2:
        out.mkdir(parents=True, exist_ok=True)
        proc = L.two_nodes(args, out, timeout=900, node_args=lambda node: [
            "--set", f"data.cache_dir={out / f'cache-node{node}'}"], **env)[0]
    else:
        proc = L.deepspeed(2, args, timeout=900, **env)
    found = LINE.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        sys.exit(f"launch in {out} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    step_s, assembly_s = float(found.group(2)), float(found.group(5))
    return float(found.group(4)), 100.0 * assembly_s / step_s if step_s > 0 else 0.0, found.group(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="the Hub launch on 1 node or 2 simulated nodes")
    ap.add_argument("--exchange-rows", type=int, default=64, help="data.exchange_rows of a 2-node launch")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, HubServer(TOKEN, deadline_s=7200) as hub:
        paths = build_embedded(Path(tmp) / "embedded", seq_len=128)
        seed_dataset(hub, HUB_REPO, corpus_files(paths.shards_dir))
        common = ["--set", f"data.plan={paths.pretrain_plan}", "--set", f"data.tokenizer={paths.tokenizer_dir}"]
        sources = {"local": (common + ["--set", f"data.shards_dir={paths.shards_dir}"], {}),
                   "hub": (common + ["--set", f"data.shards_dir=hf://datasets/{HUB_REPO}"],
                           dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1"))}
        shares: dict[str, list[tuple[float, float]]] = {name: [] for name in sources}
        for i in range(args.repeat):
            for name, (extra, env) in sources.items():
                cache = ["--set", f"data.cache_dir={Path(tmp) / f'cache-{name}-{i}'}"]  # empty: not the user's default
                nodes = args.nodes if name == "hub" else 1
                if nodes == 2:  # each node its own cache (launch); the rows travel between them
                    cache = ["--set", f"data.exchange_rows={args.exchange_rows}"]
                share, inline, line = launch(Path(tmp) / f"{name}-{i}", args.steps, extra + cache, nodes, **env)
                shares[name].append((share, inline))
                print(f"{name:5s} pass {i + 1}: {line}", flush=True)
        for name, values in shares.items():
            print(f"data wait share, {name}: median {statistics.median(v[0] for v in values):.1f} % of step time "
                  f"over {len(values)} launch(es); the assembly took the equivalent of "
                  f"{statistics.median(v[1] for v in values):.1f} % of it, in the background")


if __name__ == "__main__":
    main()
