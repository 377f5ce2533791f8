"""A Hub that stays away longer than data.hub_wait_minutes in the middle of a streamed run: the
run stops without a traceback, the rank that met it says how long it waited and what to run, the
last checkpoint is kept, and the same command with --resume auto finishes the run once the Hub
answers again.

The corpus is the demo's tokenizer over many small shards (4 rows each), so that the run still
asks the Hub for shards it has not read after its first checkpoint: the demo corpus itself has
so few that the first micro-batches' look-ahead fetches every one of them."""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.embedded import build_embedded
from ds_trhash.data.formats.shards import load_manifests, write_shards
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.plans.plan import write_plan
from ds_trhash.data.plans.plan import load_plan
from ds_trhash.data.stream.delivery.exchange import owners
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.training.callbacks.stop import LAUNCHER_GRACE_S
from tests.data.hub_corpus import TOKEN, corpus_files
from tests.release.hub_server import HubServer, seed_dataset
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e
REPO = "team/embedded-outage"


def _small_shard_corpus(root, tokenizer_dir):
    """Two sources of 24 shards of 4 rows of 128 tokens (random ids of the demo's vocabulary)
    and a plan over all of them: (corpus root, plan path)."""
    rng = np.random.default_rng(7)
    for source in ("a", "b"):
        stream = rng.integers(1, 4096, size=24 * 4 * 128 + 1)
        write_shards(source, [stream], 128, 4, root / "corpus", vocab_size=4096,
                     tokenizer_hash=tokenizer_sha256(tokenizer_dir))
    doc = build_plan(load_manifests([root / "corpus"]), 2 * 24 * 4 * 128, dataset=f"hf://datasets/{REPO}", revision="main")
    write_plan(doc, root / "plan.json")
    return root / "corpus", root / "plan.json"


def test_an_outage_beyond_the_budget_stops_cleanly_and_resume_auto_finishes(tmp_path):
    tokenizer_dir = build_embedded(tmp_path / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(tmp_path, tokenizer_dir)
    out = tmp_path / "run"
    args = L.reference_run(out, micro=8, extra=[
        "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
        "--set", f"data.tokenizer={tokenizer_dir}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
        "--set", "data.hub_wait_minutes=0.05"])  # 3 s of patience
    first_checkpoint = out / "checkpoints" / "step_00000003"
    with HubServer(TOKEN, deadline_s=600) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))

        def down_after_first_checkpoint(name):  # the first shard request after step 3's checkpoint
            if name == "resolve" and first_checkpoint.is_dir() and not hub.outage_until:
                hub.outage_headers = {"Retry-After": "1"}
                hub.outage_until = time.monotonic() + 3600

        hub.observers.append(down_after_first_checkpoint)
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1")
        stopped = L.single(args, timeout=300, **env)
        said = stopped.stdout + stopped.stderr
        assert hub.outage_until, "no shard was requested after the first checkpoint"
        assert stopped.returncode == 2 and "Traceback" not in said, L.explain(stopped)
        assert "Hub answers HTTP 503" in said and "retrying in 1 s" in said, L.explain(stopped)
        # the read gave up on the Hub itself, or on the prefetch process's download of the shard (within one budget)
        assert re.search(r"error: rank 0: cannot get \w+/\S+ (\(hf://.* after \d+ attempts over .* \(last: HTTP 503\)|"
                         r"within data.hub_wait_minutes \(3 s\): another process of this node)", said), L.explain(stopped)
        kept = L.checkpoint_steps(out)
        assert kept and f"the last complete checkpoint (step_{kept[-1]:08d}) is kept, and the same command with " \
                         "--resume auto continues from it once the Hub answers" in said, L.explain(stopped)
        hub.outage_until = -1.0  # the Hub is back
        resumed = L.single(args + ["--resume", "auto"], timeout=300, **env)
    assert resumed.returncode == 0, L.explain(resumed)
    assert f"resuming at step {kept[-1]}" in resumed.stdout + resumed.stderr
    assert L.checkpoint_steps(out)[-1] == L.REFERENCE_STEPS


def _read_by_rank_1_alone(plan, after_step: int) -> tuple[str, int]:
    """A shard that rank 1 of two (micro-batch 4) reads first at a step from ``after_step`` on,
    and rank 0 not before two steps later (its background reads never reach it): (path, step)."""
    seed = yaml.safe_load((L.REPO / "ds_configs" / "tiny" / "pretrain.yaml").read_text())["seed"]
    reader = ReplayReader(load_plan(plan), Path("."), seed)  # the run's order only: no shard is opened
    first: dict[tuple[str, str], dict[int, int]] = {}
    for step in range(L.REFERENCE_STEPS):
        for rank in (0, 1):
            layout = BatchLayout(micro_batch=4, grad_accum=1, rank=rank, world_size=2)
            for source, file, _ in reader.global_rows(layout.first_row(step, 0), 4):
                first.setdefault((source, file), {}).setdefault(rank, step)
    found = sorted((steps[1], key) for key, steps in first.items()
                   if steps.get(1, -1) >= after_step and steps.get(0, L.REFERENCE_STEPS) > steps[1] + 2)
    assert found, "no shard is read by rank 1 alone after the first checkpoint"
    return "/".join(found[0][1]), found[0][0]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """Two ranks on one node (micro-batch 4) streaming the small-shard corpus, a shard that only
    rank 1 reads unavailable (503) from step 4 on: (output dir, launch, that shard, its step)."""
    root = tmp_path_factory.mktemp("one-node")
    tokenizer_dir = build_embedded(root / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(root, tokenizer_dir)
    broken, step = _read_by_rank_1_alone(plan, after_step=4)
    out = root / "run"
    args = L.reference_run(out, micro=4, extra=[
        "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
        "--set", f"data.tokenizer={tokenizer_dir}", "--set", f"data.cache_dir={root / 'cache'}",
        "--set", "data.hub_wait_minutes=0.05", "--set", "data.prefetch_minutes=0"])
    with HubServer(TOKEN, deadline_s=600) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))
        hub.file_faults[broken] = ["503"] * 1000
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1")
        proc = L.deepspeed(2, args, **env)
    return out, proc, broken, step


def test_on_one_node_a_ranks_failed_read_stops_every_rank_at_its_step_naming_that_rank(one_node):
    """Two ranks on one node, each reading its own rows in the background: a shard only rank 1
    reads stays unavailable (503) past data.hub_wait_minutes after the first checkpoint. Both
    ranks stop at the step that needed it, without a traceback and without losing contact with
    each other: rank 1 says what it could not fetch, rank 0 that rank 1 could not read its rows,
    each with what to run next."""
    out, proc, broken, step = one_node
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said and "lost contact" not in said, L.explain(proc)
    kept = L.checkpoint_steps(out)
    advice = (f"training stopped; the last complete checkpoint (step_{kept[-1]:08d}) is kept, and the same command with "
              "--resume auto continues from it once the Hub answers")
    lines = {int(m[1]): m[2] for m in re.finditer(r"error: rank (\d): (.*)", said)}
    assert sorted(lines) == [0, 1] and all(line.endswith(advice) for line in lines.values()), L.explain(proc)
    assert lines[0] == f"rank 1 could not read its rows for step {step} (its own error is in its log); {advice}"
    assert re.match(rf"cannot get {broken} ", lines[1]), L.explain(proc)  # the Hub's words or the lock's
    assert len(L.metrics(out)) == step and kept[-1] == 3  # every step before it trained, none after


def _owned_and_read_late(plan, node: int, after_row: int) -> str:
    """A shard that ``node`` owns on two nodes and that no row before ``after_row`` reads."""
    seed = yaml.safe_load((L.REPO / "ds_configs" / "tiny" / "pretrain.yaml").read_text())["seed"]
    reader = ReplayReader(load_plan(plan), Path("."), seed)  # the run's order only: no shard is opened
    early = {(s, f) for s, f, _ in reader.global_rows(0, after_row)}
    late = [key for key, owner in owners(reader, 2).items() if owner == node and key not in early]
    assert late, "every shard of that node is read before the first checkpoint"
    return "/".join(late[0])


def test_on_two_nodes_every_rank_stops_at_one_step_saying_what_to_run(tmp_path, one_node):
    """Two nodes of two ranks each (LOCAL_SIZE 2 from the launcher), whose rows travel between the
    nodes in two exchange groups, one per local rank: each node's cache holds only the shards it
    owns, the Hub serves each shard once, and every step trains the one-node run's rows (the same
    8 rows a step: its losses, within the rounding of another reduction layout).

    Then a shard that node 0 owns stays unavailable (503) past data.hub_wait_minutes after the
    first checkpoint: every rank of both nodes stops at the same exchange, without a traceback,
    each in one line saying that --resume auto continues from the last checkpoint; a rank of node
    0 says what it could not fetch, node 1's ranks that node 0 could not read."""
    tokenizer_dir = build_embedded(tmp_path / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(tmp_path, tokenizer_dir)
    broken = _owned_and_read_late(plan, node=0, after_row=6 * 8)  # not read in the first 6 steps of 8 rows
    out = tmp_path / "run"
    args = L.reference_run(out, micro=2, extra=[
        "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
        "--set", f"data.tokenizer={tokenizer_dir}", "--set", "data.hub_wait_minutes=0.05",
        "--set", "data.exchange_rows=16"])  # two steps of 8 rows per exchange
    with HubServer(TOKEN, deadline_s=600) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))
        hub.file_faults[broken] = ["503"] * 1000
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1")
        nodes = L.two_nodes(args, tmp_path, slots=2,
                            node_args=lambda node: ["--set", f"data.cache_dir={tmp_path / f'cache-{node}'}"], **env)
        served = {p: n for p, n in hub.served.items() if p.endswith(".bin")}
    said = [proc.stdout + proc.stderr for proc in nodes]
    explained = "\n".join(L.explain(p) for p in nodes)
    assert "4 process(es)" in said[0], explained
    caches = [L.cached_shards(tmp_path / f"cache-{node}") for node in (0, 1)]
    assert caches[0] and caches[1] and not caches[0] & caches[1], caches
    assert served == {p: 1 for p in caches[0] | caches[1]}
    trained = L.train_losses(out)
    one_node_losses = L.train_losses(one_node[0])[:len(trained)]
    # the random tokens' losses differ by 1e-4 and more from one set of rows to another, and by about
    # 1e-7 between these two layouts of the same rows
    assert len(trained) >= 3 and trained[:len(one_node_losses)] == pytest.approx(one_node_losses, rel=1e-5)

    assert all(proc.returncode == 2 for proc in nodes) and not any("Traceback" in s for s in said), explained
    kept = L.checkpoint_steps(out)
    advice = (f"training stopped; the last complete checkpoint (step_{kept[-1]:08d}) is kept, and the same command with "
              "--resume auto continues from it once the Hub answers")
    lines = {int(m[1]): m[2] for m in re.finditer(r"error: rank (\d): (.*)", "\n".join(said))}
    assert sorted(lines) == [0, 1, 2, 3] and all(line.endswith(advice) for line in lines.values()), explained
    peers = [re.fullmatch(r"node 0 could not read the rows it owns for steps (\d+)-(\d+) \(its own error is in its "
                          rf"log\); {re.escape(advice)}", lines[rank]) for rank in (2, 3)]
    assert all(peers) and peers[0][1] == peers[1][1] and int(peers[0][1]) >= kept[-1] >= 3, explained
    assert any(re.match(rf"cannot get {broken} ", lines[rank]) for rank in (0, 1)), explained  # the Hub's words or the lock's
    assert "cannot get" not in said[1]  # node 1 never asked for the shard: node 0 owns it


def test_ctrl_c_on_two_nodes_while_every_download_stalls_stops_at_once_with_its_checkpoint(tmp_path):
    """Every shard download goes silent (the Hub sends half a shard, then nothing for 10 minutes)
    in the middle of a two-node run whose rows travel between the nodes, and Ctrl-C reaches both
    nodes while their reads hang: both ranks stop after the same step with one complete
    checkpoint, well inside the launcher's grace period (no exchange waits for a stalled read,
    and closing waits for no download), without a traceback. This is also the suite's Ctrl-C of a
    streamed two-node run: the same run with downloads that answer stops the same way, with less
    to wait for, so it has no launch of its own."""
    tokenizer_dir = build_embedded(tmp_path / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(tmp_path, tokenizer_dir)
    out = tmp_path / "run"
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "12",
            "--set", "batch.micro_batch=4", "--set", "training.log_every=1", "--set", "checkpoint.every_steps=1000",
            "--set", "checkpoint.packs=null", "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
            "--set", f"data.tokenizer={tokenizer_dir}", "--set", "data.exchange_rows=16", "--set", "data.prefetch_minutes=0"]
    with HubServer(TOKEN, deadline_s=900) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))
        hub.stall_s = 600.0
        stalled = []

        def stall_after_second_step(name):  # from the first shard request once two steps were logged
            if name == "resolve" and (out / "metrics.csv").exists() and len(L.metrics(out)) >= 2:
                if not stalled:
                    hub.file_faults.update({path: ["stall"] * 100 for path in corpus_files(corpus) if path.endswith(".bin")})
                stalled.append(time.monotonic())

        hub.observers.append(stall_after_second_step)
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1",
                   HF_HUB_DOWNLOAD_TIMEOUT="600")
        said, at, seconds = L.ctrl_c_two_nodes(
            args, tmp_path, lambda node: ["--set", f"data.cache_dir={tmp_path / f'cache-{node}'}"],
            lambda: len(stalled) >= 2 and time.monotonic() > stalled[1] + 3,  # downloads stalled, reads waiting on them
            out, LAUNCHER_GRACE_S, **env)
    step = L.one_stop(said, out)
    assert at <= step < 12 and seconds < LAUNCHER_GRACE_S - 10, (at, step, seconds)


def test_ctrl_c_on_two_nodes_while_the_first_shards_stall_stops_at_once_having_trained_nothing(tmp_path):
    """Every shard download goes silent from the start of a two-node run, so no rank has the rows
    of its first step, and Ctrl-C reaches both nodes while they wait for them: every rank prints
    that it stopped before its first step, nothing trained and no checkpoint written, exits 0 as
    for any agreed stop, and both nodes are gone well inside the launcher's grace period."""
    tokenizer_dir = build_embedded(tmp_path / "embedded", seq_len=128).tokenizer_dir
    corpus, plan = _small_shard_corpus(tmp_path, tokenizer_dir)
    out = tmp_path / "run"
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "12",
            "--set", "batch.micro_batch=4", "--set", "training.log_every=1", "--set", "checkpoint.packs=null",
            "--set", f"data.plan={plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
            "--set", f"data.tokenizer={tokenizer_dir}", "--set", "data.exchange_rows=16"]
    with HubServer(TOKEN, deadline_s=900) as hub:
        seed_dataset(hub, REPO, corpus_files(corpus))
        hub.stall_s = 600.0
        shards = [path for path in corpus_files(corpus) if path.endswith(".bin")]
        hub.file_faults.update({path: ["stall"] * 100 for path in shards})
        since = []

        def stalled() -> bool:  # two shard downloads hang (each node's first, or a prefetch), 3 s on
            if not since and sum(100 - len(hub.file_faults[path]) for path in shards) >= 2:
                since.append(time.monotonic())
            return bool(since) and time.monotonic() > since[0] + 3

        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", TOKENIZED_CACHE_GB="1",
                   HF_HUB_DOWNLOAD_TIMEOUT="600")
        said, at, seconds = L.ctrl_c_two_nodes(
            args, tmp_path, lambda node: ["--set", f"data.cache_dir={tmp_path / f'cache-{node}'}"], stalled,
            out, LAUNCHER_GRACE_S, **env)
    lines = re.findall(r"rank (\d)/2: stopped at step 0 of 12 before its first step: nothing was trained and no "
                       r"checkpoint was written \((.*?)\); exiting 0\n", said)
    assert sorted(rank for rank, _ in lines) == ["0", "1"], said[-5000:]
    assert all(reason.startswith("stop requested here: SIGINT") for _, reason in lines), lines
    assert at == 0 and not L.checkpoint_steps(out) and not L.foreign_tracebacks(said), said[-5000:]
    assert seconds < 25, seconds  # the launcher would have killed them at 30 s
