"""Multi-node for real, on loopback: two `deepspeed` launchers (hostfile, --no_ssh, --node_rank 0|1,
one CPU process each) train exactly what one launcher with two processes trains, step by step;
their checkpoint resumes on one node with --reshard (and with activation checkpointing switched
on, which is not training-critical). The two-node run also has TensorBoard and the CSV monitor on:
observers, so its losses still equal the reference, and its event files are read back with
TensorBoard's own reader.

The two-node run streams its shards from the loopback Hub stand-in through the real client, each
node with its own cache, while the one-node reference reads the same plan from the local corpus:
equal losses are then bit-identity of the streamed read; each shard is downloaded from the Hub
once for the whole job, by the one node that owns it (the rows the other node trains on travel
between the nodes: ``data.stream.exchange``), and the token is in no file written. In the middle of that run the Hub goes down for 45 s
(every request answered 503 with Retry-After: 5): the nodes wait it out, saying so, and the losses
are still the reference's.

Two nodes of two ranks each, whose rows travel in one exchange group per local rank, train in
tests/training/test_hub_outage_launch.py, until a shard that node 0 owns stays unavailable.
"""
import csv
import json
import re
import time

import pytest
import torch

from ds_trhash import checkpoints as ck
from ds_trhash.data.embedded import build_embedded
from tests.data.hub_corpus import TOKEN, corpus_files
from tests.release.hub_server import HubServer, seed_dataset
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS
STOP = 6  # the two-node run's checkpoint resumed on one node, which trains the rest
REPO = "team/embedded-multinode"
OUTAGE_S = 45.0  # the Hub's outage (the issue's: 45 s of 503s with Retry-After: 5), from the third shard request on


def _outage_after(hub, requests: int):
    """An observer that takes the Hub down (503, Retry-After: 5) once ``requests`` shard GETs arrived."""
    seen = {"n": 0}

    def observe(name):
        if name == "resolve":
            seen["n"] += 1
            if seen["n"] == requests:
                hub.outage_headers = {"Retry-After": "5"}
                hub.outage_until = time.monotonic() + OUTAGE_S
    return observe


def _args(out, *extra):
    """The session's 2-process reference run (12 steps, micro_batch 4, ZeRO 1, a checkpoint
    every 3 steps, every step logged) plus ``extra``."""
    return L.reference_run(out, micro=4, extra=extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_launches):
    """(root, both launchers' results, the Hub's complete shard GETs after the two-node run, the
    Hub and its client environment); the Hub stays up for the module (the resume reads from it).
    ``root / "one-node"`` is the session's shared 2-process reference, read only."""
    root = tmp_path_factory.mktemp("multinode")
    one_node = shared_launches.get(2, _args)  # the embedded corpus, from local disk
    (root / "one-node").symlink_to(one_node, target_is_directory=True)
    paths = build_embedded(one_node.parent / "embedded", seq_len=128)  # the corpus that run built: read, not rebuilt
    with HubServer(TOKEN, deadline_s=900) as hub:
        seed_dataset(hub, REPO, corpus_files(paths.shards_dir))
        hub.observers.append(_outage_after(hub, 3))
        env = dict(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN, HF_HUB_DISABLE_XET="1", HF_HUB_DOWNLOAD_TIMEOUT="60")
        streamed = ["--set", f"data.plan={paths.pretrain_plan}", "--set", f"data.shards_dir=hf://datasets/{REPO}",
                    "--set", f"data.tokenizer={paths.tokenizer_dir}",
                    "--set", "data.exchange_rows=16"]  # two steps of 8 rows: an exchange every other step
        nodes = L.two_nodes(_args(root / "two-nodes", "--set", "deepspeed.tensorboard.enabled=true",
                                  "--set", "deepspeed.csv_monitor.enabled=true", *streamed), root,
                            node_args=lambda node: ["--set", f"data.cache_dir={root / f'cache-node{node}'}"], **env)
        for proc in nodes:
            assert proc.returncode == 0, L.explain(proc)
        served = {p: n for p, n in hub.served.items() if p.endswith(".bin")}
        assert hub.outage_answers >= 2, "the outage never met a request"
        yield root, nodes, served, (streamed, env)


def test_two_nodes_match_two_processes_on_one_node_step_by_step(runs):
    root, nodes, _, _ = runs
    one, two = L.train_losses(root / "one-node"), L.train_losses(root / "two-nodes")
    assert len(one) == STEPS and two == one  # bit-identical losses, every step
    assert "2 process(es)" in nodes[0].stderr + nodes[0].stdout
    assert "startup summary" not in nodes[1].stdout + nodes[1].stderr  # rank 0 reports, on node 0
    wait = re.search(rf"data wait on rank 0: [\d.]+ s of [\d.]+ s in {STEPS} step\(s\) \([\d.]+ %\) waiting for batches; "
                     r".* [\d.]+ s waiting for shards \([\d.]+ %\) \((\d+) fetched on demand, (\d+) prefetched",
                     nodes[0].stdout + nodes[0].stderr)
    assert wait and int(wait[1]) + int(wait[2]) >= 1, L.explain(nodes[0])  # node 0 downloaded what it read
    assert "data wait on rank" not in nodes[1].stdout + nodes[1].stderr


def test_the_hubs_outage_was_waited_out_one_line_per_wait(runs):
    said = "".join(proc.stdout + proc.stderr for proc in runs[1])
    waits = re.findall(r"Hub answers HTTP 503 for \S+ .*; retrying in 5 s, waited [\dms ]+ of 30 m", said)
    assert waits, said[-4000:]
    assert "Traceback" not in said


def test_expert_load_is_summed_over_both_nodes(runs):
    """expert_load.csv counts every rank's routes: two nodes write what one node with two
    processes writes, and each layer's routes are two per token of the step (top-2)."""
    root = runs[0]
    text = (root / "two-nodes" / "expert_load.csv").read_text()
    assert text == (root / "one-node" / "expert_load.csv").read_text()
    with open(root / "two-nodes" / "expert_load.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    tokens = {0: 0, **{int(r["step"]): int(r["tokens_seen"]) for r in L.metrics(root / "two-nodes")}}
    assert sorted({int(r["step"]) for r in rows}) == list(range(1, STEPS + 1))
    for r in rows:
        routes = sum(int(v) for k, v in r.items() if k.startswith("expert_"))
        assert routes == 2 * (tokens[int(r["step"])] - tokens[int(r["from_step"])]), r


def test_monitor_event_files_read_back_with_tensorboards_reader(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = runs[0]
    mon = root / "two-nodes" / "monitors" / "pretraining"
    acc = EventAccumulator(str(mon))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/loss", "Train/loss_interval_mean", "Train/lr", "Train/grad_norm", "Train/tokens_per_s",
            "Train/step_time_s", "Train/peak_memory_mib", "Experts/layer_00/expert_0"} <= tags
    metrics = L.metrics(root / "two-nodes")
    assert [e.step for e in acc.Scalars("Train/loss")] == [int(r["step"]) for r in metrics]
    assert [e.value for e in acc.Scalars("Train/loss")] == pytest.approx([float(r["train_loss"]) for r in metrics],
                                                                          rel=1e-6)  # float32 events
    assert all(float(r["grad_norm"]) > 0 and float(r["step_time"]) > 0 for r in metrics)
    shares = [acc.Scalars(f"Experts/layer_00/expert_{e}")[0].value for e in range(4)]
    assert sum(shares) == pytest.approx(1.0) and all(0 < s < 1 for s in shares)
    with open(root / "two-nodes" / "expert_load.csv", newline="") as f:
        first = next(csv.DictReader(f))  # step 1, layer 0: the same routes as the monitor's shares
    counts = [int(first[f"expert_{e}"]) for e in range(4)]
    assert shares == pytest.approx([c / sum(counts) for c in counts], rel=1e-6)
    with open(mon / "Train_grad_norm.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [float(r["grad_norm"]) for r in rows] == pytest.approx([float(r["grad_norm"]) for r in metrics], rel=1e-6)


def test_each_shard_is_downloaded_once_per_job_and_the_token_is_in_no_file(runs):
    """Each node's cache holds only the shards it owns, and the Hub served each shard once: the
    other node's rows of it came from its owner, not from the Hub."""
    root, nodes, served, (_, env) = runs
    caches = [L.cached_shards(root / f"cache-node{node}") for node in (0, 1)]
    assert caches[0] and caches[1], caches  # both nodes streamed into their own caches
    assert not caches[0] & caches[1]  # never one shard on both nodes
    assert served == {p: 1 for p in caches[0] | caches[1]}  # about 1x egress for the whole job
    assert not (root / "two-nodes" / "shard_staging").exists()
    state = json.loads((root / "two-nodes" / "checkpoints" / f"step_{STOP:08d}" / "trainer_state.json").read_text())
    assert state["data_source"]["store"] == f"hf:{env['HF_ENDPOINT']}/datasets/{REPO}"
    written = [p for p in root.rglob("*") if p.is_file()]
    assert written and not [p for p in written if TOKEN.encode() in p.read_bytes()]


def test_two_node_checkpoint_resumes_on_one_node_with_reshard(runs, tmp_path):
    root, _, _, (streamed, env) = runs
    out = tmp_path / "resumed"
    # the two-node run's checkpoint at STOP, as if that run had been stopped there
    import shutil

    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "two-nodes" / "checkpoints" / f"step_{STOP:08d}", out / "checkpoints" / f"step_{STOP:08d}")
    with open(root / "two-nodes" / "metrics.csv", newline="") as f:
        rows = f.read().splitlines()
    (out / "metrics.csv").write_text("\n".join(rows[: STOP + 1]) + "\n")
    proc = L.single(_args(out, "--set", "model.activation_checkpointing=full", "--resume", "auto", "--reshard", *streamed),
                    **env)  # the recorded commit, from the Hub still up
    assert proc.returncode == 0, L.explain(proc)
    assert f"--reshard: step {STOP} of a 2-rank run resumed on 1 rank(s)" in proc.stderr, L.explain(proc)
    assert "activation checkpointing  full: 4 of 4 decoder layers" in proc.stdout, L.explain(proc)
    log = proc.stdout + proc.stderr
    assert "converting" in log and "universal" in log, L.explain(proc)  # DeepSpeed's universal checkpoint
    assert "re-seeded from (seed, step, rank)" in log, L.explain(proc)  # what could not be restored
    assert not (out / ck.RESHARD_DIR).exists()  # the universal copy is gone once loaded
    reference = L.train_losses(root / "one-node")
    resumed = L.train_losses(out)
    assert resumed[:STOP] == reference[:STOP] and len(resumed) == STEPS
    assert resumed[STOP:] == pytest.approx(reference[STOP:], rel=1e-4)  # another reduction layout: close
    last = out / "checkpoints" / f"step_{STEPS:08d}"
    state = json.loads((last / ck.TRAINER_STATE).read_text())
    assert state["world_size"] == 1 and state["data_cursor"] == STEPS * 8  # the same global rows, 8 a step
    final, want = L.model_weights(last), L.model_weights(root / "one-node" / "checkpoints" / f"step_{STEPS:08d}")
    assert final.keys() == want.keys()
    for name in final:
        torch.testing.assert_close(final[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_unequal_nodes_are_refused_at_once_on_both_naming_each_nodes_ranks(runs, tmp_path):
    """Hostfile slots 2 + 1 with a corpus streamed from the Hub (its rows would travel in groups
    of one rank per node): every rank of both nodes refuses before any model is built, naming
    each node's rank count, instead of one node refusing and the other waiting in new_group."""
    _, _, _, (streamed, env) = runs
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(tmp_path / "run"), "--max-steps", "3",
            "--set", "batch.micro_batch=1", "--set", "batch.global_tokens=768", *streamed]  # 6 rows: 3 ranks split them
    started = time.monotonic()
    nodes = L.two_nodes(args, tmp_path, timeout=240, slots=(2, 1), **env,
                        node_args=lambda node: ["--set", f"data.cache_dir={tmp_path / f'cache-{node}'}"])
    seconds = time.monotonic() - started
    said = [proc.stdout + proc.stderr for proc in nodes]
    explained = "\n".join(L.explain(p) for p in nodes)
    refusal = ("the nodes run 2 + 1 ranks (their hostfile slots, in node order; LOCAL_SIZE or LOCAL_WORLD_SIZE): rows "
               "travel between nodes in groups of one rank per node, so every node must run the same number of ranks; "
               "give every host the same slots in the hostfile")
    assert all(proc.returncode == 2 for proc in nodes), explained
    assert [f"error: rank {rank}: {refusal}" in said[rank // 2] for rank in range(3)] == [True] * 3, explained
    assert not any("Traceback" in s for s in said) and not (tmp_path / "run" / "checkpoints").exists(), explained
    assert seconds < 200, seconds  # at once: no rank waited for a group the others never formed
