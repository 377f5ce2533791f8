"""Real launches with kernels.compile and the kernel self-check.

One compiled run (each decoder layer compiled with inductor on the engine path) is resumed from
its mid-run checkpoint and must end bit-identical to itself, with checkpoint names unchanged; a
launch whose selected Triton kernel fails the start-up self-check under policy triton exits 2
before writing anything.
"""
import json
import os
import shutil

import pytest
import torch

from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("compile")


def _args(out, *sets):
    args = ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "4",
            "--set", "kernels.compile=layers", "--set", "checkpoint.every_steps=2", "--set", "checkpoint.packs=null",
            "--set", "training.log_every=1", "--set", "batch.micro_batch=2"]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def compiled_run(root):
    out = root / "full"
    proc = L.single(_args(out))
    assert proc.returncode == 0, L.explain(proc)
    return out


def test_a_compiled_engine_run_resumes_bit_identically_with_unchanged_names(root, compiled_run):
    final = compiled_run / "checkpoints" / "step_00000004"
    weights = L.model_weights(final)
    assert not [k for k in weights if "_orig_mod" in k]
    assert "layers.0.mlp.engine.expert_gate" in weights and "embed_tokens.weight" in weights
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["backends_used"]["compile"] == "layers"

    resumed = root / "resumed"  # the same run, stopped after its step-2 checkpoint
    shutil.copytree(compiled_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    proc = L.single(_args(resumed) + ["--resume", "auto"])
    assert proc.returncode == 0, L.explain(proc)
    assert "resuming at step 2" in proc.stdout, L.explain(proc)
    L.assert_identical(L.model_weights(resumed / "checkpoints" / "step_00000004"), weights)
    assert L.train_losses(resumed) == L.train_losses(compiled_run)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton experts need CUDA or, on CPU, the interpreter")
def test_a_kernel_failing_its_self_check_fails_policy_triton_with_exit_2(root):
    out = root / "faulty"
    proc = L.single(_args(out, "kernels.policy=triton", "kernels.compile=none"), DS_TRHASH_FAULTY_KERNEL="experts")
    assert proc.returncode == 2, L.explain(proc)
    assert "self-check of the triton experts kernel" in proc.stderr and "Traceback" not in proc.stderr
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [p for p in written if "checkpoints" in p.parts or p.name == "metrics.csv"], written
