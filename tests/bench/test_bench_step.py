"""The step benchmark's CPU smoke mode runs every non-compile case end to end (bench/bench_step.py).

The GPU figures come from a CUDA machine; here we only check that the script the GPU session
will run works: it builds each path in a process of its own, times it, records the backends and
writes its JSON; a case whose process crashes or hangs is recorded with its error.
"""
from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.training.launch_utils import base_env, free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_step.py"
SMOKE = ["--device", "cpu", "--preset", "tiny", "--seq-len", "64", "--micro-batch", "2",
         "--steps", "2", "--precision", "fp32"]


def _module(name: str):
    """A bench module by file (bench/ is not a package the tests import from)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    assert list(cases) == ["compile_masked", "engine", "manual", "engine_compile", "engine_compile_model",
                           "compile", "eager"]
    for name in ("eager", "manual", "engine"):
        case = cases[name]
        assert case["status"] == "ok", case
        assert case["tokens_per_s"] > 0 and case["model_tflops"] > 0
        assert len(case["step_s"]) == 2
        # backends_used() of the model after the run: everything that ran is named
        assert case["backends"]["experts"] == "pytorch", case["backends"]
        assert case["backends"]["loss"] == "chunked", case["backends"]
        assert all(case["losses"]) and all(x == x for x in case["losses"])  # finite, no NaN
        assert case["checkpointed_layers"] == []  # the config's activation checkpointing: none
        assert "child_exit" not in case  # each ran in its own process, which ended cleanly
    # torch.compile takes minutes on CPU: skipped with the reason, not silently dropped
    for name in ("compile_masked", "compile", "engine_compile", "engine_compile_model"):
        assert cases[name]["status"] == "skipped" and "--cpu-compile" in cases[name]["reason"]
    assert cases["engine"]["kernel_choice"]["experts"] == "pytorch"  # policy auto on CPU
    assert report["meta"]["matmul_peak"]["tflops"] > 0
    assert report["meta"]["reference_shape"] is False and report["meta"]["isolated"] is True
    assert report["meta"]["anchor_case"] == "compile_masked"
    assert "overhead_vs_manual" in report["comparisons"]["engine"]
    assert "speedup_vs_anchor" not in report["comparisons"]["engine"]  # the anchor did not run here
    # the human table is on stdout too
    assert "tokens/s" in proc.stdout and "engine" in proc.stdout and "experts=pytorch" in proc.stdout


def test_a_failing_case_is_reported_and_the_others_still_run(tmp_path):
    out = tmp_path / "bench_step.json"
    # policy triton cannot run on CPU without the interpreter: the manual case fails, eager runs,
    # with the config's activation checkpointing overridden (as model.activation_checkpointing
    # would set it) and two micro-batches per step; both in this one process (--in-process: the
    # smoke run above covers the process per case)
    proc = _run([*SMOKE, "--cases", "manual,eager", "--kernels-policy", "triton", "--activation-checkpointing",
                 "full", "--grad-accum", "2", "--in-process", "--json", str(out)])
    assert proc.returncode == 1, _explain(proc)
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert cases["manual"]["status"] == "error" and "BackendError" in cases["manual"]["error"]
    assert "Traceback" in cases["manual"]["traceback"]
    assert cases["eager"]["status"] == "ok" and cases["eager"]["tokens_per_s"] > 0
    assert cases["eager"]["checkpointed_layers"] == [0, 1, 2, 3]  # every layer of the tiny preset
    assert report["meta"]["tokens_per_step"] == 2 * 2 * 64 and report["meta"]["activation_checkpointing"] == "full"
    assert report["meta"]["isolated"] is False


def test_a_crashed_or_hung_case_process_is_recorded_with_its_error(tmp_path):
    """What an illegal memory access does to a case (its process dies, possibly in cleanup) and
    what a hang does: the parent records the error from the output's tail and goes on."""
    child = _module("step_child")
    crash = ("import os, sys; print('Traceback (most recent call last):'); "
             "print('torch.AcceleratorError: CUDA error: an illegal memory access was encountered'); "
             "sys.stdout.flush(); os.abort()")
    res = child.run_child([sys.executable, "-c", crash], tmp_path / "none.json", 60, "engine_compile_model")
    assert res["status"] == "crashed" and res["child_exit"] < 0, res
    assert res["error"] == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert "Traceback" in res["traceback"]
    hang = child.run_child([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "none.json", 1, "x")
    assert hang["status"] == "timeout" and "--case-timeout 1" in hang["error"], hang
    # the result came back, then the process died in its cleanup: the result stands, the exit is noted
    done = tmp_path / "done.json"
    write = f"import json, os; open({str(done)!r}, 'w').write(json.dumps({{'case': 'x', 'status': 'ok'}})); os._exit(3)"
    res = child.run_child([sys.executable, "-c", write], done, 60, "x")
    assert res == {"case": "x", "status": "ok", "child_exit": 3}


def test_every_ratio_is_against_the_anchor_of_the_same_run():
    report = _module("step_report")
    results = {"compile_masked": {"status": "ok", "tokens_per_s": 200.0},
               "engine": {"status": "ok", "tokens_per_s": 300.0},
               "manual": {"status": "ok", "tokens_per_s": 312.0},
               "engine_compile_model": {"status": "crashed", "error": "x"}}
    comps = report.comparisons(results)
    assert comps["engine"]["speedup_vs_anchor"] == pytest.approx(1.5)
    assert comps["engine"]["overhead_vs_manual"] == pytest.approx(0.04)
    assert comps["manual"] == {"speedup_vs_anchor": pytest.approx(1.56)}
    assert "compile_masked" not in comps and "engine_compile_model" not in comps
    rows = {r["target"]: r for r in report.targets(results, comps, reference_shape=True)}
    assert rows["speed-up vs compile_masked (same run) >= 1.2x"]["verdict"] == "PASS"
    assert rows["engine overhead vs manual <= 5 %"]["verdict"] == "PASS"
    assert rows["tokens/s >= 300,000"]["verdict"] == "FAIL"


def test_flops_per_token_formula_gives_the_issue_constant():
    mod = _module("bench_step")
    from ds_trhash.model.config import TRHashConfig

    cfg = TRHashConfig.from_preset("200m")
    assert mod.train_flops_per_token(cfg, 2048) == pytest.approx(1.35e9, rel=1e-3)
    assert mod.flops_per_token("200m", cfg, 2048, None)[0] == 1.35e9
    tiny = TRHashConfig.from_preset("tiny")
    assert mod.flops_per_token("tiny", tiny, 64, None)[0] == mod.train_flops_per_token(tiny, 64)


def test_the_anchor_computes_the_same_model_with_masked_experts():
    """compile_masked swaps each MoE block's routed experts for the masked formulation: the same
    function of the same weights as the model's gathered path."""
    cases = _module("step_cases")
    from ds_trhash.model import TRHashConfig, TRHashForCausalLM

    cfg = TRHashConfig.from_preset("tiny", num_layers=2)
    torch.manual_seed(0)
    model = TRHashForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = model(ids, labels=ids.roll(-1, 1))
    masked = cases._masked_engine_class()
    for engine in model.engines():
        engine.__class__ = masked
    got = model(ids, labels=ids.roll(-1, 1))
    assert model.backends_used()["experts"] == "masked"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_bench_stopped_by_timeout_leaves_no_case_process_behind(tmp_path):
    """`timeout` sends the bench SIGTERM while a case runs in its child (a session of its own):
    the child is killed with it, so the next step of a GPU session has the device to itself."""
    pid_file = tmp_path / "child.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import signal, sys\n"
        f"sys.path.insert(0, {str(REPO / 'bench')!r})\n"
        "from pathlib import Path\n"
        "from step_child import run_child\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        f"run_child([sys.executable, '-c', {sleeper!r}], Path({str(tmp_path / 'none.json')!r}), 120, 'x')\n")
    proc = subprocess.Popen([sys.executable, str(parent)])
    for _ in range(200):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    for _ in range(100):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
