"""`torchrun` starts the trainer too: two CPU processes on one node train exactly what the
`deepspeed` launcher's two processes train (the session's shared 12-step reference), step by step,
to the same final weights (README "Training a stage", docs/operations.md "torchrun")."""
from __future__ import annotations

import subprocess

import pytest

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def _args(out):
    return L.reference_run(out, micro=4)  # tests/training/test_multinode.py's one-node reference


def test_torchrun_two_processes_train_what_the_deepspeed_launcher_trains(shared_launches, tmp_path):
    reference = shared_launches.get(2, _args)
    out = tmp_path / "torchrun"
    cmd = [str(L.VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "launch/train.py", *_args(out)]
    proc = subprocess.run(cmd, cwd=L.REPO, env=L.base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, L.explain(proc)
    assert "on 2 process(es)" in proc.stdout + proc.stderr
    assert L.train_losses(out) == L.train_losses(reference) and len(L.train_losses(out)) == L.REFERENCE_STEPS
    L.assert_identical(L.model_weights(out / "checkpoints" / "step_00000012"),
                       L.model_weights(reference / "checkpoints" / "step_00000012"))
