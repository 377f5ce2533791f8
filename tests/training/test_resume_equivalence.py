"""The proof of exact resume: a run SIGKILLed at a random step (or in the middle of writing a
checkpoint) and resumed with --resume auto ends bit-identical to an uninterrupted run."""

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


def test_sigkill_at_a_random_step_then_resume_auto_is_bit_identical(root, reference):
    """On two ranks; a killed single process and its resume are the truncated case below."""
    nproc = 2
    seed, kill_at = _kill_step(nproc)
    print(f"SIGKILL after step {kill_at} (rerun this case with KILL_SEED={seed})")
    out = root / f"kill{nproc}-{kill_at}"
    proc = _launch(nproc, _args(out, micro=8 // nproc), DS_TRHASH_FAULT=f"kill_after_step:{kill_at}")
    assert L.was_killed(proc), f"the run was not killed at step {kill_at} (KILL_SEED={seed}): " + L.explain(proc)
    last_saved = (kill_at - 1) // 3 * 3  # killed after step kill_at, before its own checkpoint
    assert max(L.checkpoint_steps(out)) == last_saved
    resumed = _resume_and_compare(nproc, out, reference(nproc))
    assert f"resuming at step {last_saved}" in resumed.stdout, f"kill_at={kill_at} KILL_SEED={seed}\n" + L.explain(resumed)


def test_sigkill_while_writing_a_checkpoint_falls_back_to_the_previous_one(root, reference):
    """On two ranks, whose files the publish waits for (one process writes the same files, and
    takes the same publish, without the wait: the truncated case below runs on one)."""
    nproc = 2
    out = root / f"killsave{nproc}"
    proc = _launch(nproc, _args(out, micro=8 // nproc), DS_TRHASH_FAULT="kill_during_save:6")
    assert L.was_killed(proc), L.explain(proc)
    ckroot = out / "checkpoints"
    assert (ckroot / "step_00000006.tmp").is_dir()  # DeepSpeed's files were written ...
    assert not (ckroot / "step_00000006").exists()  # ... but the checkpoint never became visible
    assert L.checkpoint_steps(out) == [3]
    resumed = _resume_and_compare(nproc, out, reference(nproc))
    assert "resuming at step 3" in resumed.stdout, L.explain(resumed)


def test_auto_resume_skips_a_truncated_newest_checkpoint(root, reference):
    """One process SIGKILLed after step 8, its newest checkpoint (step 6) then damaged: the
    resume says why it passes over it and continues from step 3, bit-identically."""
    out = root / "truncated"
    proc = _launch(1, _args(out), DS_TRHASH_FAULT="kill_after_step:8")
    assert proc.returncode != 0
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
