"""--reshard: a resume onto another world size through DeepSpeed's universal checkpoint.

A 2-process ZeRO-2 run (micro_batch 4) stopped at step 6 continues on 1 process (micro_batch 8, the same
global batch of 8 rows per step): it resumes at step 6, reads the same global rows at every later
step, and its loss curve continues the 2-process one (close, not bit-identical: the gradients are
reduced over another layout and the RNG of the new rank is re-seeded). A plain --resume across
world sizes, and a reshard that changes the global batch, are refused before anything is built.
The same resume from ZeRO 1 is tests/training/test_multinode.py's, of its two-node run.
"""

import json
import shutil

import pytest
import torch

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import CheckpointError, ResumeError
from tests.training import launch_utils as L


STEPS = L.REFERENCE_STEPS
STOP = 6
GLOBAL = 8  # rows per optimizer step in every layout below


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


_args = L.reference_run


def _step_dir(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def two_rank_run(shared_launches):
    """Uninterrupted 2-process runs (micro_batch 4), one per ZeRO stage, launched once per session
    (the ZeRO-1 one is also the exact-resume tests' 2-process reference, the ZeRO-2 one
    tests/training/test_launch.py's two-process launch)."""
    return lambda zero: shared_launches.get(2, lambda o: _args(o, micro=4, zero=zero))


def _stopped_at(reference, out):
    """The 2-process run as it stood when stopped at STOP: its checkpoint and its metrics up to it."""
    out.mkdir()
    shutil.copytree(_step_dir(reference, STOP), _step_dir(out, STOP))
    shutil.copy(reference / "metrics.csv", out / "metrics.csv")
    return out


@pytest.mark.e2e
def test_reshard_from_2_processes_to_1_continues_with_the_same_rows_and_loss(root, two_rank_run):
    """ZeRO 2 (its optimizer partitioned over the two ranks); the ZeRO-1 2 -> 1 reshard is the
    resume on one node of tests/training/test_multinode.py's two-node run, with the same checks."""
    zero = 2
    reference = two_rank_run(zero)
    out = _stopped_at(reference, root / f"resharded-z{zero}")

    proc = L.single(_args(out, micro=8, zero=zero, extra=["--resume", "auto", "--reshard"]))
    assert proc.returncode == 0, L.explain(proc)
    log = proc.stdout + proc.stderr
    assert f"resuming at step {STOP}" in proc.stdout, L.explain(proc)
    assert "converting" in log and "universal" in log, L.explain(proc)
    assert "re-seeded from (seed, step, rank)" in log, L.explain(proc)  # what could not be restored
    assert not (out / ck.RESHARD_DIR).exists()  # the universal copy is gone once loaded

    ref_losses, losses = L.train_losses(reference), L.train_losses(out)
    assert len(ref_losses) == len(losses) == STEPS
    assert losses[:STOP] == ref_losses[:STOP]  # the history before the stop is kept
    # The curve continues: no jump back to the ~8.3 of a fresh model, and every resumed step
    # lands on the 2-process curve (reduction order only, far inside 2 %).
    assert losses[STOP] < ref_losses[0] - 0.5
    for step in range(STOP, STEPS):
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-3), (step + 1, losses, ref_losses)

    state = json.loads((_step_dir(out, STEPS) / ck.TRAINER_STATE).read_text())
    assert state["world_size"] == 1 and state["data_cursor"] == STEPS * GLOBAL
    final, ref_final = L.model_weights(_step_dir(out, STEPS)), L.model_weights(_step_dir(reference, STEPS))
    assert final.keys() == ref_final.keys()
    for name in final:
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.e2e
def test_the_same_global_rows_are_read_in_every_layout_of_the_global_batch(root, two_rank_run):
    """The data order is world-size independent: with G fixed, step s reads rows [s·G, (s+1)·G)."""
    from ds_trhash.data.plans.plan import load_plan
    from ds_trhash.batch_layout import BatchLayout
    from ds_trhash.data.stream.delivery import ReplayReader

    from ds_trhash.data.embedded import build_embedded

    # the corpus the launch built beside its output directory: found by its content hash, not rebuilt
    embedded = build_embedded(two_rank_run(1).parent / "embedded")
    reader = ReplayReader(load_plan(embedded.pretrain_plan), embedded.shards_dir, 1234)

    def step_rows(step, world, micro, accum):
        layouts = [BatchLayout(micro_batch=micro, grad_accum=accum, rank=r, world_size=world) for r in range(world)]
        parts = [reader.batch(step, m, layout)[0] for m in range(accum) for layout in layouts]
        return torch.cat(parts)

    for step in range(STOP, STEPS):
        two = step_rows(step, 2, 4, 1)
        assert two.shape[0] == GLOBAL
        assert torch.equal(two, step_rows(step, 1, 8, 1))
        assert torch.equal(two, step_rows(step, 1, 4, 2))
        assert torch.equal(two, step_rows(step, 4, 1, 2))
        refs = reader.global_rows(step * GLOBAL, GLOBAL)
        assert len(refs) == GLOBAL


@pytest.mark.e2e
def test_plain_resume_onto_another_world_size_is_refused_and_points_to_reshard(root, two_rank_run):
    out = _stopped_at(two_rank_run(1), root / "plain")
    proc = L.single(_args(out, micro=8, extra=["--resume", "auto"]))
    assert proc.returncode == 2, L.explain(proc)
    assert "world_size: checkpoint 2, this run 1" in proc.stderr and "--reshard" in proc.stderr, L.explain(proc)
    assert not _step_dir(out, 9).exists() and not (out / ck.RESHARD_DIR).exists()


@pytest.mark.e2e
def test_reshard_that_changes_the_global_batch_is_refused_naming_both(root, two_rank_run):
    out = _stopped_at(two_rank_run(1), root / "global-batch")
    # a per-rank batch (no global_tokens): micro_batch 4 on one rank is half the checkpoint's batch
    proc = L.single(_args(out, micro=4, extra=["--resume", "auto", "--reshard", "--set", "batch.global_tokens=null"]))
    assert proc.returncode == 2, L.explain(proc)
    assert "global batch: checkpoint 8 rows per step (micro_batch 4 × grad_accum 1 × 2 ranks), this run 4 rows " \
           "per step (micro_batch 4 × grad_accum 1 × 1 rank)" in proc.stderr, L.explain(proc)
    assert not (out / ck.RESHARD_DIR).exists()


# ----------------------------------------------------------------------------- in process


@pytest.mark.e2e
def test_universal_conversion_verifies_its_source_and_reuses_only_a_verified_copy(root, two_rank_run, tmp_path):
    source = tmp_path / "checkpoints" / f"step_{STOP:08d}"
    shutil.copytree(_step_dir(two_rank_run(1), STOP), source)
    messages = []

    first = ck.convert_to_universal(source, tmp_path, log=messages.append)
    assert first == ck.universal_dir_for(tmp_path, STOP)
    assert (first / ck.ENGINE_TAG / "zero" / "optimizer_state.pt").is_file()
    assert (first / ck.UNIVERSAL_RECORD).is_file() and not first.with_name(first.name + ".tmp").exists()
    assert ck.convert_to_universal(source, tmp_path, log=messages.append) == first
    assert any("reusing" in m for m in messages)

    # A damaged conversion is not reused; it is made again.
    victim = first / ck.ENGINE_TAG / "zero" / "optimizer_state.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    messages.clear()
    ck.convert_to_universal(source, tmp_path, log=messages.append)
    assert any("discarding" in m for m in messages) and any("converting" in m for m in messages)

    # A damaged source is refused before any conversion.
    shutil.rmtree(first)
    model_file = source / ck.ENGINE_TAG / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:-100])
    with pytest.raises(ResumeError, match="cannot reshard .* corrupt"):
        ck.convert_to_universal(source, tmp_path)
    assert not first.exists()


@pytest.mark.e2e
def test_an_engine_built_without_load_universal_is_refused_for_a_reshard(root, two_rank_run):
    class Engine:  # only what load_engine_state asks before loading
        def load_universal_checkpoint(self):
            return False

    with pytest.raises(CheckpointError, match="load_universal=True"):
        ck.load_engine_state(Engine(), _step_dir(two_rank_run(1), STOP), reshard=True, output_dir=root / "unused")
    assert ck.needs_universal(_step_dir(two_rank_run(1), STOP))


@pytest.fixture()
def deepspeed_env(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(L.free_port())).items():
        monkeypatch.setenv(key, value)


@pytest.mark.e2e
def test_universal_load_restores_every_weight_frozen_ones_included(root, two_rank_run, tmp_path, deepspeed_env):
    """In process, on 1 rank: the 2-rank ZeRO-1 checkpoint loads bit-exact (fp32), the schedule
    and step with it. A frozen parameter (as in LoRA mode) is not held by the optimizer, which is
    all that DeepSpeed's universal load restores; it still comes back from the checkpoint."""
    import dataclasses

    from ds_trhash.model import TRHashConfig, TRHashForCausalLM
    from ds_trhash.training import config as tcfg
    from ds_trhash.training.engine import build_engine, init_distributed

    source = tmp_path / "checkpoints" / f"step_{STOP:08d}"
    shutil.copytree(_step_dir(two_rank_run(1), STOP), source)
    cfg = tcfg.load_config("ds_configs/tiny/pretrain.yaml", ["batch.micro_batch=8", "zero.stage=1"])
    model = TRHashForCausalLM(dataclasses.replace(TRHashConfig.from_preset("tiny"), loss_chunk_tokens=256))
    frozen_name, frozen = next((n, p) for n, p in model.named_parameters() if p.ndim == 2 and "layers.0." in n)
    frozen.requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    init_distributed()  # a 1-rank gloo group in this process
    engine = build_engine(model, cfg, tcfg.to_deepspeed_dict(cfg, 1), STEPS, load_universal=True)
    ck.load_engine_state(engine.engine, source, reshard=True, output_dir=tmp_path)

    saved = L.model_weights(source)
    now = engine.engine.module.state_dict()
    assert saved.keys() == now.keys()
    different = [k for k in saved if not torch.equal(saved[k], now[k])]
    assert not different, different
    assert torch.count_nonzero(now[frozen_name]) > 0
    sched = torch.load(source / ck.ENGINE_TAG / "mp_rank_00_model_states.pt", weights_only=False)["lr_scheduler"]
    assert engine.scheduler.last_epoch == sched["last_epoch"] == STOP
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(sched["_last_lr"][0])
    assert not ck.universal_dir_for(tmp_path, STOP).exists()


def _saved(world, **critical):
    """A trainer_state.json of a run stopped at STOP on ``world`` ranks with micro_batch G / world."""
    return {"stage": "pretraining", "step": STOP, "epoch": 0, "data_cursor": STOP * GLOBAL, "world_size": world,
            "plan_fingerprint": None, "plan_sha256": None, "backends_used": {}, "lora": False, "family": "language",
            "training_critical": {"batch.micro_batch": GLOBAL // world, "batch.grad_accum": 1, **critical}}


def _compat(saved_world, world, micro, accum, reshard=True, **changes):
    saved = _saved(saved_world, seed=1)
    current = {"batch.micro_batch": micro, "batch.grad_accum": accum, "seed": 1, **changes}
    ck.check_resume_compatible(saved, current, world_size=world, lora_enabled=False, total_steps=STEPS,
                               reshard=reshard)


def test_reshard_rule_batch_layout_may_change_only_with_the_global_batch():
    _compat(2, 1, 8, 1)
    _compat(2, 1, 4, 2)
    _compat(2, 4, 1, 2)
    _compat(2, 2, 2, 2)  # same world size: an exact resume with another micro-batch split
    with pytest.raises(ResumeError, match=r"global batch: checkpoint 8 rows per step .*, this run 16 rows per step"):
        _compat(2, 1, 8, 2)
    with pytest.raises(ResumeError, match="seed: checkpoint 1, this run 2"):  # everything else still matches
        _compat(2, 1, 8, 1, seed=2)
    with pytest.raises(ResumeError, match="batch.micro_batch: checkpoint 4, this run 8"):  # not without --reshard
        _compat(2, 1, 8, 1, reshard=False)


def test_an_expert_parallel_checkpoint_reshards_onto_any_expert_layout_with_the_global_batch():
    saved = _saved(2, **{"parallel.ep_size": 2})
    for world, ep in ((1, 1), (2, 1), (4, 4), (4, 2), (8, 2)):
        current = {"batch.micro_batch": GLOBAL // world, "batch.grad_accum": 1, "parallel.ep_size": ep}
        ck.check_resume_compatible(saved, current, world_size=world, lora_enabled=False, total_steps=STEPS,
                                   reshard=True)
    assert ck.is_reshard(saved, 2, True, 1) and ck.is_reshard(saved, 1, True, 1)  # the experts move
    assert not ck.is_reshard(saved, 2, True, 2) and not ck.is_reshard(saved, 2, False, 1)
    with pytest.raises(ResumeError, match="parallel.ep_size: checkpoint 2, this run 1"):  # not without --reshard
        ck.check_resume_compatible(saved, {"batch.micro_batch": 4, "batch.grad_accum": 1, "parallel.ep_size": 1},
                                   world_size=2, lora_enabled=False, total_steps=STEPS, reshard=False)
    with pytest.raises(ResumeError, match="global batch: checkpoint 8 rows"):  # the global batch still holds
        ck.check_resume_compatible(saved, {"batch.micro_batch": 4, "batch.grad_accum": 1, "parallel.ep_size": 1},
                                   world_size=1, lora_enabled=False, total_steps=STEPS, reshard=True)


def test_reseeding_after_a_reshard_is_deterministic_per_rank():
    seeds = {ck.reshard_rng_seed(1234, STOP, r) for r in range(4)}
    assert len(seeds) == 4 and ck.reshard_rng_seed(1234, STOP, 0) == ck.reshard_rng_seed(1234, STOP, 0)
    assert ck.reshard_rng_seed(1234, STOP + 1, 0) != ck.reshard_rng_seed(1234, STOP, 0)
    ck.reseed_rng_for_reshard(1234, STOP, 1)
    a = torch.rand(3)
    ck.reseed_rng_for_reshard(1234, STOP, 1)
    assert torch.equal(a, torch.rand(3))
