"""Multi-node for real, on loopback: two `deepspeed` launchers (hostfile, --no_ssh, --node_rank 0|1,
one CPU process each) train exactly what one launcher with two processes trains, step by step;
their checkpoint resumes on one node with --reshard (and with activation checkpointing switched
on, which is not training-critical). The two-node run also has TensorBoard and the CSV monitor on:
observers, so its losses still equal the reference, and its event files are read back with
TensorBoard's own reader.
"""
import csv

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.launch

STEPS = 4
STOP = 2  # the two-node run stops here; the one-node resume trains the rest


def _args(out, steps, *extra):
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(STEPS),
            "--set", "training.log_every=1", "--set", "checkpoint.packs=null", "--set", "checkpoint.every_steps=1",
            "--set", "checkpoint.keep_last=null", "--set", "zero.stage=1", *extra] + \
        (["--set", f"training.max_steps={steps}"] if steps != STEPS else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    single = L.deepspeed(2, _args(root / "one-node", STEPS))
    assert single.returncode == 0, L.explain(single)
    nodes = L.two_nodes(_args(root / "two-nodes", STEPS, "--set", "deepspeed.tensorboard.enabled=true",
                              "--set", "deepspeed.csv_monitor.enabled=true"), root)
    for proc in nodes:
        assert proc.returncode == 0, L.explain(proc)
    return root, nodes


def test_two_nodes_match_two_processes_on_one_node_step_by_step(runs):
    root, nodes = runs
    one, two = L.train_losses(root / "one-node"), L.train_losses(root / "two-nodes")
    assert len(one) == STEPS and two == one  # bit-identical losses, every step
    assert "2 process(es)" in nodes[0].stderr + nodes[0].stdout
    assert "startup summary" not in nodes[1].stdout + nodes[1].stderr  # rank 0 reports, on node 0


def test_expert_load_is_summed_over_both_nodes(runs):
    """expert_load.csv counts every rank's routes: two nodes write what one node with two
    processes writes, and each layer's routes are two per token of the step (top-2)."""
    root, _ = runs
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

    root, _ = runs
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


def test_two_node_checkpoint_resumes_on_one_node_with_reshard(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "resumed"
    # the two-node run's checkpoint at STOP, as if that run had been stopped there
    import shutil

    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "two-nodes" / "checkpoints" / f"step_{STOP:08d}", out / "checkpoints" / f"step_{STOP:08d}")
    with open(root / "two-nodes" / "metrics.csv", newline="") as f:
        rows = f.read().splitlines()
    (out / "metrics.csv").write_text("\n".join(rows[: STOP + 1]) + "\n")
    proc = L.single(_args(out, STEPS, "--set", "model.activation_checkpointing=full", "--resume", "auto", "--reshard"))
    assert proc.returncode == 0, L.explain(proc)
    assert "--reshard: step 2 of a 2-rank run resumed on 1 rank(s)" in proc.stderr, L.explain(proc)
    assert "activation checkpointing  full: 4 of 4 decoder layers" in proc.stdout, L.explain(proc)
    reference = L.train_losses(root / "one-node")
    resumed = L.train_losses(out)
    assert resumed[:STOP] == reference[:STOP] and len(resumed) == STEPS
    assert resumed[STOP:] == pytest.approx(reference[STOP:], rel=1e-4)  # another reduction layout: close
