"""Real launches of the tiny config: the deepspeed launcher with one and two CPU processes,
each ZeRO stage, and the loss falling on the embedded corpus."""

import json
import math

import pytest
import torch

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # One folder for all launches so the embedded corpus (root/embedded) is built once.
    return tmp_path_factory.mktemp("launch")


def _args(out, steps, *sets):
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", str(steps),
            "--set", "checkpoint.every_steps=4", "--set", "training.log_every=1"]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def one_process(root):
    """The one-process deepspeed launch (ZeRO-1, 8 steps, steps 5-6 profiled): (output dir, launcher result)."""
    out = root / "one"
    return out, L.deepspeed(1, _args(out, 8, "zero.stage=1", "profile.steps=5,6"))


@pytest.fixture(scope="module")
def two_processes(shared_launches):
    """The two-process deepspeed launch over gloo (ZeRO-2, 12 steps): the session's shared ZeRO-2
    reference (also tests/checkpoints/test_reshard.py's), which succeeded or was not returned."""
    return shared_launches.get(2, lambda o: L.reference_run(o, micro=4, zero=2))


def test_one_process_deepspeed_launch_trains_writes_metrics_and_checkpoint(one_process):
    out, proc = one_process
    assert proc.returncode == 0, L.explain(proc)
    rows = L.metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert rows[0]["experts_backend"] == "pytorch" and rows[0]["loss_backend"] == "chunked"
    assert L.checkpoint_steps(out)[-1] == 8
    assert (out / "checkpoints" / "step_00000008" / "MANIFEST.json").is_file()


def test_profile_steps_write_a_trace_per_rank_and_stay_out_of_the_steady_rate(one_process):
    """--set profile.steps=5,6: a torch.profiler Chrome trace of steps 5 and 6 under the run folder
    (what TensorBoard and Perfetto open); the launch's end line gives its steady tokens/s with the
    warm-up, checkpoint and profiled steps left out."""
    out, proc = one_process
    assert proc.returncode == 0, L.explain(proc)
    traces = list((out / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, sorted((out / "profile").iterdir()) if (out / "profile").exists() else "no profile/"
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#5", "ProfilerStep#6"}, steps
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the step's own ops
    assert "profile of steps 5-6: " in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if "throughput: steady" in ln)
    # steps 1-3 warm-up, 4 the profiler's warm-up and a checkpoint, 5-6 profiled (6 also saves at
    # the token pack boundary ceil(2 * 8 / 3)), 8 a checkpoint: step 7 alone is steady
    assert "over 1 steps (7-7; left out: 3 warm-up, 3 checkpoint, 3 profile)" in line, line


def test_two_process_deepspeed_launch_trains_on_gloo(two_processes):
    out = two_processes
    assert len(L.metrics(out)) == L.REFERENCE_STEPS
    state = (out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text()
    assert '"world_size": 2' in state
    # ZeRO-2 over two ranks: one optimizer partition per rank
    files = {p.name for p in (out / "checkpoints" / "step_00000006" / "state").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_each_zero_stage_trains(request, zero):
    """Each stage the config allows trains, in a run this module makes anyway: stage 0 is the
    shared 30-step pretraining (one plain process), 1 the one-process launch above and 2 the
    two-process one (the shared ZeRO-2 reference). DeepSpeed's own record of the stage it ran is
    read back from the last checkpoint."""
    if zero == 0:
        out = request.getfixturevalue("shared_launches").get(1, L.tiny_pretraining)
    elif zero == 1:
        out, proc = request.getfixturevalue("one_process")
        assert proc.returncode == 0, L.explain(proc)
    else:
        out = request.getfixturevalue("two_processes")
    losses = L.train_losses(out)
    assert losses and all(math.isfinite(l) for l in losses)
    last = out / "checkpoints" / f"step_{L.checkpoint_steps(out)[-1]:08d}" / "state" / "mp_rank_00_model_states.pt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["ds_config"]["zero_optimization"]["stage"] == zero


def test_loss_falls_on_the_embedded_corpus(shared_launches):
    out = shared_launches.get(1, L.tiny_pretraining)  # 30 steps; also where the SFT stage tests start
    losses = L.train_losses(out)
    assert len(losses) == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert first > 8.0  # about ln(4096) at initialisation
    assert last < first - 1.0, losses


def test_bad_config_is_refused_before_training(root):
    out = root / "bad"
    proc = L.single(["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--set", "zero.stage=3"])
    assert proc.returncode == 2
    assert "zero.stage" in proc.stderr and "ZeRO-3" in proc.stderr
    assert not (out / "checkpoints").exists()


def test_target_tokens_and_repetition_are_refused_before_the_model(root):
    out = root / "target"
    proc = L.single(["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out)], TARGET_TOKENS="12345")
    assert proc.returncode == 2, L.explain(proc)
    assert "TARGET_TOKENS" in proc.stderr and "12345" in proc.stderr
    proc = L.single(["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "100000"])
    assert proc.returncode == 2, L.explain(proc)
    assert "automatic dataset repetition is forbidden" in proc.stderr
    assert not (out / "checkpoints").exists() and not (out / "metrics.csv").exists()


def test_token_pack_boundaries_are_tagged_checkpoints(one_process):
    """The one-process launch: 8 steps in the tiny config's 3 token packs (checkpoint.packs) end at
    steps ceil(i * 8 / 3) = 3, 6, 8, each a checkpoint tagged with its pack; every_steps=4 adds
    step 4, untagged. All four are kept: keep_last (3) never removes a pack's checkpoint."""
    out, proc = one_process
    assert proc.returncode == 0, L.explain(proc)
    assert L.checkpoint_steps(out) == [3, 4, 6, 8]
    tags = {s: json.loads((out / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())["pack_index"]
            for s in (3, 4, 6, 8)}
    assert tags == {3: 1, 4: None, 6: 2, 8: 3}


def test_a_fresh_launch_never_writes_over_an_existing_run(one_process):
    out, launched = one_process
    assert launched.returncode == 0, L.explain(launched)
    before = (out / "metrics.csv").read_text()
    proc = L.single(_args(out, 2))
    assert proc.returncode == 2, L.explain(proc)
    assert "already holds a run" in proc.stderr and "--resume auto" in proc.stderr
    assert (out / "metrics.csv").read_text() == before
