"""`ds-trhash preflight` through the real console script: one passing launch of the tiny config,
and every failure it exists for provoked once, each refused with exit 2 on the line of the
check that failed while nothing on disk changes.

The runs are independent processes, so they run side by side (those needing the smoke's
checkpoint start once it exists) and each test reads its own result."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.ops.conftest import ds_trhash, tree_digest

PRETRAIN, REFINE, SFT = "ds_configs/tiny/pretrain.yaml", "ds_configs/tiny/refine.yaml", "ds_configs/tiny/sft.yaml"
CHECKS = ("config", "devices", "precision", "package deepspeed", "kernels", "deepspeed ops", "data", "output",
          "stage", "memory", "disk")


def _plan_args(plan: Path, shards: Path) -> list[str]:
    return ["--set", f"data.plan={plan}", "--set", f"data.shards_dir={shards}"]


def _independent(root: Path, corpus) -> dict[str, tuple[list, dict]]:
    """Cases that need only the corpus; their inputs are made here, under ``root``."""
    paths = corpus["paths"]
    missing, corrupt = root / "shards_missing", root / "shards_corrupt"
    shutil.copytree(paths.shards_dir, missing)
    shutil.copytree(paths.shards_dir, corrupt)
    (missing / "topics_b" / "shard-00001.bin").unlink()
    shard = corrupt / "topics_a" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, one byte changed: only a hash finds it
    shard.write_bytes(bytes(data))
    shadow = root / "shadow" / "deepspeed"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: deepspeed is not installed')\n")
    fresh = ["--output-dir", str(root / "fresh_run")]
    plan = paths.pretrain_plan
    return {
        "pass": ([PRETRAIN, *fresh], {}),
        "missing_shard": ([PRETRAIN, *fresh, *_plan_args(plan, missing)], {}),
        "wrong_hash": ([PRETRAIN, *fresh, *_plan_args(plan, corrupt), "--deep"], {}),
        "target_tokens": ([PRETRAIN, *fresh, *_plan_args(plan, paths.shards_dir)], {"TARGET_TOKENS": "123456"}),
        "disk": ([PRETRAIN, *fresh, *_plan_args(plan, paths.shards_dir)], {"DS_TRHASH_TEST_DISK_FREE": "1000"}),
        "package": ([PRETRAIN, *fresh, *_plan_args(plan, paths.shards_dir)],
                    {"PYTHONPATH": str(root / "shadow")}),
    }


def _with_source(root: Path, corpus, smoke) -> dict[str, tuple[list, dict]]:
    """Cases that start from the smoke's pretraining checkpoint or write over its run."""
    other, source = corpus["other"], ["--init-checkpoint", str(smoke["checkpoint"])]
    return {
        "wrong_tokenizer": ([REFINE, "--output-dir", str(root / "refine_run"), *source,
                             *_plan_args(other.refine_plan, other.shards_dir)], {}),
        "pretraining_to_sft": ([SFT, "--output-dir", str(root / "sft_run"), *source, "--source-stage", "refinement",
                                "--set", f"data.sft_dir={corpus['sft']}"], {}),
        "output_holds_run": ([PRETRAIN, "--output-dir", str(smoke["workdir"] / "run")], {}),
    }


def _preflight(case):
    argv, env = case
    return ds_trhash("preflight", "--config", *argv, timeout=300, **env)


@pytest.fixture(scope="module")
def results(request, corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    first = _independent(root, corpus)
    before = {"inputs": tree_digest(root), "corpus": tree_digest(corpus["root"])}
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {name: pool.submit(_preflight, case) for name, case in first.items()}
        smoke = request.getfixturevalue("smoke_run")  # runs meanwhile, in this thread
        smoke_before = tree_digest(smoke["workdir"])
        second = _with_source(root, corpus, smoke)
        running.update({name: pool.submit(_preflight, case) for name, case in second.items()})
        done = {name: future.result() for name, future in running.items()}
    after = {"inputs": tree_digest(root), "corpus": tree_digest(corpus["root"])}
    return {"runs": done, "unchanged": before == after and smoke_before == tree_digest(smoke["workdir"])}


def _lines(proc) -> dict[str, list[tuple[str, str]]]:
    """check name -> [(PASS|WARN|FAIL, detail)] from the printed lines."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in proc.stdout.splitlines():
        mark, _, rest = line.partition("  ")
        if mark in ("PASS", "WARN", "FAIL"):
            name, _, detail = rest.partition(": ")
            out.setdefault(name, []).append((mark, detail))
    return out


def test_tiny_config_passes_every_check(results):
    proc = results["runs"]["pass"]
    lines = _lines(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(CHECKS) <= set(lines), f"missing checks: {set(CHECKS) - set(lines)}\n{proc.stdout}"
    assert all(mark != "FAIL" for marks in lines.values() for mark, _ in marks), proc.stdout
    assert "1,024 tokens per optimizer step" in lines["config"][0][1]
    assert "60 steps" in lines["data"][0][1] and "14 shards" in lines["data"][0][1]
    assert "a fresh start" in lines["output"][0][1]
    assert "3 at once" in lines["disk"][0][1]  # tiny pretraining keeps its 3 token-pack checkpoints
    assert "Traceback" not in proc.stderr
    assert results["unchanged"], "a preflight run changed files"


@pytest.mark.parametrize("case, check, needle", [
    ("missing_shard", "data", "topics_b/shard-00001.bin is missing"),
    ("wrong_hash", "data", "topics_a/shard-00000.bin: SHA-256 differs from its manifest"),
    ("target_tokens", "data", "TARGET_TOKENS 123456 != the plan's trained_tokens 160768"),
    ("disk", "disk", "0.0 MiB free under"),
    ("package", "package deepspeed", "simulated: deepspeed is not installed"),
    ("wrong_tokenizer", "stage", "was trained with tokenizer"),
    ("pretraining_to_sft", "stage", "pretraining -> supervised-finetuning is not an allowed transition"),
    ("output_holds_run", "output", "already holds a run"),
])
def test_each_failure_is_refused_on_its_own_line(results, case, check, needle):
    proc = results["runs"][case]
    lines = _lines(proc)
    failed = {name for name, marks in lines.items() for mark, _ in marks if mark == "FAIL"}
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert failed == {check}, f"failed: {failed}\n{proc.stdout}"
    assert any(needle in detail for mark, detail in lines[check] if mark == "FAIL"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("fix the failed checks before launching")
    assert results["unchanged"], "a refused preflight changed files"
