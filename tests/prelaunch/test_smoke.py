"""`ds-trhash smoke` on the tiny pretraining config through the real console script and the
deepspeed launcher: the figures it reports, the arithmetic of its projection, and a failure
named by its step. Plus the checkpoint plan the projection and preflight size the disk with."""
from __future__ import annotations

import math

import pytest

from ds_trhash.training.checkpoint_plan import CheckpointPlan


@pytest.mark.e2e
def test_smoke_reports_positive_figures(prelaunch_runs):
    out, r = prelaunch_runs["smoke"].stdout, prelaunch_runs["report"]
    for step in ("train", "save", "resume", "evaluate", "export", "project"):
        assert f"smoke {step}" in out, out
    train, save = r["train"], r["save"]
    for value in (train["step_seconds"], train["tokens_per_second"], train["peak_memory_bytes"],
                  save["checkpoint_bytes"], save["save_seconds"], r["export"]["bytes"], r["evaluate"]["loss"]):
        assert value > 0 and math.isfinite(value), r
    assert train["tokens_per_step"] == 8 * 128  # micro_batch x seq_len x 1 process
    assert train["tokens_per_second"] == pytest.approx(train["tokens_per_step"] / train["step_seconds"])
    assert r["resume"] == {**r["resume"], "from_step": 2, "to_step": 4, "identical": True}
    # the preflight's size estimate is what DeepSpeed writes, within 2 %
    assert save["estimated_checkpoint_bytes"] == pytest.approx(save["checkpoint_bytes"], rel=0.02)
    assert "smoke passed" in out


@pytest.mark.e2e
def test_projection_arithmetic(prelaunch_runs):
    r = prelaunch_runs["report"]
    p = r["projection"]
    # tiny pretraining: 60 steps (training.max_steps), saved at the 3 token-pack boundaries 20/40/60,
    # which rotation never removes
    assert (p["total_steps"], p["saves"], p["kept_checkpoints"]) == (60, 3, 3)
    assert p["step_seconds"] == r["train"]["step_seconds"] and p["save_seconds"] == r["save"]["save_seconds"]
    assert p["checkpoint_bytes"] == r["save"]["checkpoint_bytes"]
    assert p["wall_seconds"] == pytest.approx(60 * p["step_seconds"] + 3 * p["save_seconds"])
    assert p["disk_bytes"] == 3 * p["checkpoint_bytes"]


@pytest.mark.e2e
def test_failure_names_the_step(prelaunch_runs):
    """TARGET_TOKENS off the plan: the first launch refuses, and the smoke says at which step."""
    proc = prelaunch_runs["failing_smoke"]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "smoke FAILED at step train" in proc.stderr
    assert "TARGET_TOKENS 123 != the plan's trained_tokens" in proc.stderr
    assert (prelaunch_runs["failing_workdir"] / "logs" / "train.log").is_file()  # kept for reading


def test_checkpoint_plan_pack_boundaries_and_rotation():
    # 10 steps, a save every 2, packs at 5 and 10, keep the newest 2 unprotected
    plan = CheckpointPlan(total_steps=10, every_steps=2, keep_last=2, pack_of={5: 1, 10: 2})
    assert plan.save_steps() == [2, 4, 5, 6, 8, 10]
    assert plan.reason(5) == "token pack boundary" and plan.reason(4) == "every_steps" and plan.reason(3) is None
    # after 8: {4, 5, 6, 8} -> rotation keeps 6, 8 and pack 5; then 10 is written beside them
    assert plan.peak_kept() == 4
    assert CheckpointPlan(total_steps=10, every_steps=2, keep_last=None).peak_kept() == 5  # nothing rotated
    assert plan.peak_kept(after=6, existing=[5, 6]) == 4


def test_checkpoint_plan_epochs():
    plan = CheckpointPlan(total_steps=7, keep_last=1, epoch_ends=frozenset({3, 6}))
    assert plan.save_steps() == [3, 6, 7] and plan.reason(7) == "final" and plan.peak_kept() == 3
