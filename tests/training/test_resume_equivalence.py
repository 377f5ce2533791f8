"""The proof of exact resume: a run SIGKILLed at a random step (or in the middle of writing a
checkpoint) and resumed with --resume auto ends bit-identical to an uninterrupted run. On two
ranks one run meets both kills, each resumed by the next launch; on one process, a stopped run
whose newest checkpoint is then damaged."""

import json
import os
import random
import shutil

import pytest
import torch

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e

STEPS = L.REFERENCE_STEPS


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


_args = L.reference_run


def _launch(nproc, args, **env):
    return L.single(args, **env) if nproc == 1 else L.deepspeed(nproc, args, **env)


@pytest.fixture(scope="module")
def reference(shared_launches):
    """Uninterrupted runs, one per world size, computed once (the 2-process one is also the
    ZeRO-1 reference of the reshard, expert-parallel and streaming tests: one launch)."""
    cache = {}

    def get(nproc):
        if nproc not in cache:
            out = shared_launches.get(nproc, lambda o: _args(o, micro=8 // nproc))
            cache[nproc] = out, L.model_weights(out / "checkpoints" / f"step_{STEPS:08d}")
        return cache[nproc]

    return get


def _resume_and_compare(nproc, out, ref):
    ref_out, ref_weights = ref
    proc = _launch(nproc, _args(out, micro=8 // nproc) + ["--resume", "auto"])
    assert proc.returncode == 0, L.explain(proc)
    L.assert_identical(L.model_weights(out / "checkpoints" / f"step_{STEPS:08d}"), ref_weights)
    # every step logged: the routes of each step, summed over the ranks, once, as uninterrupted
    assert (out / "expert_load.csv").read_text() == (ref_out / "expert_load.csv").read_text()
    return proc


def _kill_step(nproc: int) -> tuple[int, int]:
    """(seed, step): a step that is not the last, drawn from ``KILL_SEED`` when set (to rerun a
    failure exactly), else from a fresh seed; the test prints both."""
    seed = int(os.environ.get("KILL_SEED") or random.SystemRandom().randrange(2**32))
    return seed, random.Random(seed * 10 + nproc).randrange(4, STEPS)


@pytest.fixture(scope="module")
def killed_twice(root, reference):
    """One two-rank run killed twice, each launch the same command with --resume auto after the
    first: SIGKILL inside the write of step 6's checkpoint, then, resumed, SIGKILL after a random
    later step, then resumed to the end and compared with the uninterrupted run. What each launch
    said and the losses logged when it was killed."""
    nproc, out = 2, root / "killed-twice"
    seed, kill_at = _kill_step(nproc)
    print(f"SIGKILL after step {kill_at} (rerun this case with KILL_SEED={seed})")
    args = _args(out, micro=8 // nproc)
    in_save = _launch(nproc, args, DS_TRHASH_FAULT="kill_during_save:6")
    left = {"tmp": (out / "checkpoints" / "step_00000006.tmp").is_dir(), "steps": L.checkpoint_steps(out)}
    at_step = _launch(nproc, args + ["--resume", "auto"], DS_TRHASH_FAULT=f"kill_after_step:{kill_at}")
    logged = L.whole_losses(out)
    saved = L.checkpoint_steps(out)
    end = _resume_and_compare(nproc, out, reference(nproc))
    return {"in_save": in_save, "left": left, "at_step": at_step, "logged": logged, "saved": saved, "end": end,
            "kill_at": kill_at, "seed": seed, "reference": L.train_losses(reference(nproc)[0])}


def test_sigkill_while_writing_a_checkpoint_falls_back_to_the_previous_one(killed_twice):
    """On two ranks, whose files the publish waits for (one process writes the same files, and
    takes the same publish, without the wait: the truncated case below runs on one)."""
    run = killed_twice
    assert L.was_killed(run["in_save"]), L.explain(run["in_save"])
    assert run["left"]["tmp"]  # DeepSpeed's files were written ...
    assert run["left"]["steps"] == [3]  # ... but step 6's checkpoint never became visible
    resumed = run["at_step"]
    assert "resuming at step 3" in resumed.stdout, L.explain(resumed)
    # every step the resumed launch trained before its own kill: the uninterrupted run's loss
    assert len(run["logged"]) >= run["kill_at"] - 1 and run["logged"] == run["reference"][:len(run["logged"])]


def test_sigkill_at_a_random_step_then_resume_auto_is_bit_identical(killed_twice):
    """The resumed launch killed after a random step (before that step's own checkpoint): the
    next resume continues from the last checkpoint before it and ends bit-identical (weights,
    expert counts) to the uninterrupted run; a killed single process and its resume:
    tests/ops/test_jobs.py."""
    run, kill_at, seed = killed_twice, killed_twice["kill_at"], killed_twice["seed"]
    assert L.was_killed(run["at_step"]), f"not killed at step {kill_at} (KILL_SEED={seed}): " + L.explain(run["at_step"])
    last_saved = (kill_at - 1) // 3 * 3  # killed after step kill_at, before its own checkpoint
    assert run["saved"][-1] == last_saved, (run["saved"], kill_at, seed)
    assert f"resuming at step {last_saved}" in run["end"].stdout, f"kill_at={kill_at} KILL_SEED={seed}\n" + L.explain(
        run["end"])


def test_auto_resume_skips_a_truncated_newest_checkpoint(root, reference):
    """One process stopped after step 8 (the uninterrupted one-process run's folder without its
    later checkpoints), its newest checkpoint (step 6) then damaged: the resume says why it passes
    over it and continues from step 3, bit-identically. A killed single process resumed:
    tests/ops/test_jobs.py (supervisord restarts it)."""
    out = root / "truncated"
    shutil.copytree(reference(1)[0], out)
    for later in (9, 12):
        shutil.rmtree(out / "checkpoints" / f"step_{later:08d}")
    victim = out / "checkpoints" / "step_00000006" / "state" / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:-100])
    resumed = _resume_and_compare(1, out, reference(1))
    assert "step_00000006" in resumed.stdout + resumed.stderr  # it says why it fell back
    assert "resuming at step 3" in resumed.stdout, L.explain(resumed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_run_stopped_after_a_checkpoint_resumes_bit_identically(root):
    """On a GPU, in bf16 with ZeRO 1 and the fused kernels (Triton experts, Liger loss, norm and
    RoPE): the run's folder as a stop after its step-3 checkpoint leaves it, resumed with --resume
    auto, logs the uninterrupted run's losses and ends on its weights, bit for bit. FlashAttention's
    backward and cuBLAS are made deterministic by training.deterministic (on by default), which the
    start-up summary states."""
    def args(out):
        return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "6",
                "--set", "checkpoint.every_steps=3", "--set", "checkpoint.keep_last=10", "--set", "checkpoint.packs=null",
                "--set", "training.log_every=1", "--set", "precision=bf16", "--set", "zero.stage=1",
                "--set", "kernels.policy=auto"]

    full = root / "gpu-full"
    proc = L.single(args(full))
    assert proc.returncode == 0, L.explain(proc)
    assert "determinism  on: torch.use_deterministic_algorithms" in proc.stdout, L.explain(proc)
    state = json.loads((full / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())
    assert state["backends_used"]["experts"] == "triton" and state["backends_used"]["loss"] == "liger", state

    resumed = root / "gpu-resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    proc = L.single(args(resumed) + ["--resume", "auto"])
    assert proc.returncode == 0, L.explain(proc)
    assert "resuming at step 3" in proc.stdout, L.explain(proc)
    assert L.train_losses(resumed) == L.train_losses(full) and len(L.train_losses(full)) == 6
    L.assert_identical(L.model_weights(resumed / "checkpoints" / "step_00000006"),
                       L.model_weights(full / "checkpoints" / "step_00000006"))
