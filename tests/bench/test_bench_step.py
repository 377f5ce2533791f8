"""The step benchmark's CPU smoke mode runs every non-compile case end to end (bench/bench_step.py).

The GPU figures come from a CUDA machine; here we only check that the script the GPU session
will run works: it builds each path, times it, records the backends and writes its JSON.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.launch_utils import base_env, free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_step.py"
SMOKE = ["--device", "cpu", "--preset", "tiny", "--seq-len", "64", "--micro-batch", "2",
         "--steps", "2", "--precision", "fp32"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    # base_env: the venv's bin first on PATH, OMP_NUM_THREADS=1. One in-process DeepSpeed rank,
    # as the script sets up by default.
    env = base_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    # tests/conftest.py turns the Triton interpreter on for this process; a user's smoke run
    # has it off, and the failure test below relies on that (policy triton then cannot run).
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_step.json"
    proc = _run([*SMOKE, "--json", str(out)])
    return proc, out


def test_smoke_mode_runs_every_case(smoke):
    proc, out = smoke
    assert proc.returncode == 0, _explain(proc)
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert list(cases) == ["engine", "manual", "compile", "eager", "engine_compile", "engine_compile_model"]
    for name in ("eager", "manual", "engine"):
        case = cases[name]
        assert case["status"] == "ok", case
        assert case["tokens_per_s"] > 0 and case["model_tflops"] > 0
        assert len(case["step_s"]) == 2
        # backends_used() of the model after the run: everything that ran is named
        assert case["backends"]["experts"] == "pytorch", case["backends"]
        assert case["backends"]["loss"] == "chunked", case["backends"]
        assert all(case["losses"]) and all(x == x for x in case["losses"])  # finite, no NaN
    # torch.compile takes minutes on CPU: skipped with the reason, not silently dropped
    for name in ("compile", "engine_compile", "engine_compile_model"):
        assert cases[name]["status"] == "skipped" and "--cpu-compile" in cases[name]["reason"]
    assert cases["engine"]["kernel_choice"]["experts"] == "pytorch"  # policy auto on CPU
    assert report["meta"]["matmul_peak"]["tflops"] > 0
    assert report["meta"]["reference_shape"] is False
    assert "overhead_vs_manual" in report["comparisons"]["engine"]
    # the human table is on stdout too
    assert "tokens/s" in proc.stdout and "engine" in proc.stdout and "experts=pytorch" in proc.stdout


def test_a_failing_case_is_reported_and_the_others_still_run(tmp_path):
    out = tmp_path / "bench_step.json"
    # policy triton cannot run on CPU without the interpreter: the manual case fails, eager runs
    proc = _run([*SMOKE, "--cases", "manual,eager", "--kernels-policy", "triton", "--json", str(out)])
    assert proc.returncode == 1, _explain(proc)
    cases = json.loads(out.read_text())["cases"]
    assert cases["manual"]["status"] == "error" and "BackendError" in cases["manual"]["error"]
    assert cases["eager"]["status"] == "ok" and cases["eager"]["tokens_per_s"] > 0


def test_flops_per_token_formula_gives_the_issue_constant():
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from ds_trhash.model.config import TRHashConfig

    cfg = TRHashConfig.from_preset("200m")
    assert mod.train_flops_per_token(cfg, 2048) == pytest.approx(1.35e9, rel=1e-3)
    assert mod.flops_per_token("200m", cfg, 2048, None)[0] == 1.35e9
    tiny = TRHashConfig.from_preset("tiny")
    assert mod.flops_per_token("tiny", tiny, 64, None)[0] == mod.train_flops_per_token(tiny, 64)
