"""Every process the preflight and smoke tests start, run side by side once per session.

The smoke of the tiny config runs in the calling thread while two workers run the preflight
cases that need only the demo corpus and the failing smoke; the cases that start from the
smoke's checkpoint (or point at its run) follow once it exists. Tree digests taken before and
after prove that no refused command changed a file."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.fail_closed import tree_digest
from tests.training.launch_utils import REPO, base_env, single

VENV_BIN = Path(sys.executable).parent
PRETRAIN, REFINE, SFT = "ds_configs/tiny/pretrain.yaml", "ds_configs/tiny/refine.yaml", "ds_configs/tiny/sft.yaml"


def ds_trhash(*args, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`ds-trhash ...` as a user runs it, from the repository root."""
    return subprocess.run([str(VENV_BIN / "ds-trhash"), *map(str, args)], cwd=REPO, env=base_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _plan(plan: Path, shards: Path) -> list[str]:
    return ["--set", f"data.plan={plan}", "--set", f"data.shards_dir={shards}"]


def corpus_only_cases(root: Path, corpus) -> dict[str, tuple[list, dict]]:
    """Preflight cases needing only the corpus; their inputs are made here, under ``root``."""
    paths = corpus["paths"]
    missing, corrupt = root / "shards_missing", root / "shards_corrupt"
    shutil.copytree(paths.shards_dir, missing)
    shutil.copytree(paths.shards_dir, corrupt)
    (missing / "topics_b" / "shard-00001.bin").unlink()
    shard = corrupt / "topics_a" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size, one byte changed: only a hash finds it
    shard.write_bytes(bytes(data))
    shadow = root / "shadow" / "deepspeed"  # hides the installed DeepSpeed from the preflight process
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: deepspeed is not installed')\n")
    fresh, plan = ["--output-dir", str(root / "fresh_run")], paths.pretrain_plan
    return {
        "pass": ([PRETRAIN, *fresh], {}),
        "missing_shard": ([PRETRAIN, *fresh, *_plan(plan, missing)], {}),
        "wrong_hash": ([PRETRAIN, *fresh, *_plan(plan, corrupt), "--deep"], {}),
        "target_tokens": ([PRETRAIN, *fresh, *_plan(plan, paths.shards_dir)], {"TARGET_TOKENS": "123456"}),
        "disk": ([PRETRAIN, *fresh, *_plan(plan, paths.shards_dir)], {"DS_TRHASH_TEST_DISK_FREE": "1000"}),
        # (importing the shadow package would otherwise write its bytecode cache into the tree digested)
        "package": ([PRETRAIN, *fresh, *_plan(plan, paths.shards_dir)],
                    {"PYTHONPATH": str(root / "shadow"), "PYTHONDONTWRITEBYTECODE": "1"}),
        # shards on a Hub that cannot be reached (nothing listens on the discard port)
        "no_network": ([PRETRAIN, *fresh, *_plan(plan, "hf://datasets/team/corpus")],
                       {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_notatoken"}),
    }


def source_cases(root: Path, corpus, smoke_workdir: Path) -> dict[str, tuple[list, dict]]:
    """Preflight cases that start from the smoke's pretraining checkpoint or point at its run."""
    other = corpus["other"]
    source = ["--init-checkpoint", str(smoke_workdir / "run" / "checkpoints" / "step_00000004")]
    return {
        "wrong_tokenizer": ([REFINE, "--output-dir", str(root / "refine_run"), *source,
                             *_plan(other.refine_plan, other.shards_dir)], {}),
        "pretraining_to_sft": ([SFT, "--output-dir", str(root / "sft_run"), *source, "--source-stage", "refinement",
                                "--set", f"data.sft_dir={corpus['sft']}"], {}),
        "output_holds_run": ([PRETRAIN, "--output-dir", str(smoke_workdir / "run")], {}),
        "finished_auto": ([PRETRAIN, "--output-dir", str(smoke_workdir / "run"), "--max-steps", "4",
                           "--resume", "auto"], {}),
    }


def _preflight(case):
    argv, env = case
    return ds_trhash("preflight", "--config", *argv, **env)


def run_all(root: Path, corpus) -> dict:
    inputs, smoke_root = root / "preflight", root / "smoke"
    inputs.mkdir()
    first = corpus_only_cases(inputs, corpus)
    before = tree_digest(inputs), tree_digest(corpus["root"])
    paths = corpus["paths"]
    launch = ["--config", PRETRAIN, "--output-dir", str(inputs / "launch_run"), "--max-steps", "2",
              *_plan(paths.pretrain_plan, paths.shards_dir)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        full_disk_launch = pool.submit(single, launch, DS_TRHASH_TEST_DISK_FREE="1000")
        failing = pool.submit(ds_trhash, "smoke", "--config", PRETRAIN, "--steps", "2", "--workdir",
                              smoke_root / "failing", TARGET_TOKENS="123")
        running = {name: pool.submit(_preflight, case) for name, case in first.items()}
        smoke = ds_trhash("smoke", "--config", PRETRAIN, "--steps", "4", "--workdir", smoke_root / "work",
                          "--json", smoke_root / "smoke.json", timeout=600)
        assert smoke.returncode == 0, f"exit {smoke.returncode}\n{smoke.stdout[-3000:]}\n{smoke.stderr[-5000:]}"
        smoke_before = tree_digest(smoke_root / "work")
        running.update({name: pool.submit(_preflight, case)
                        for name, case in source_cases(inputs, corpus, smoke_root / "work").items()})
        preflight = {name: future.result() for name, future in running.items()}
        failing = failing.result()
        full_disk_launch = full_disk_launch.result()
    unchanged = (before == (tree_digest(inputs), tree_digest(corpus["root"]))
                 and smoke_before == tree_digest(smoke_root / "work"))
    return {"preflight": preflight, "unchanged": unchanged, "smoke": smoke, "failing_smoke": failing,
            "full_disk_launch": full_disk_launch, "launch_run": inputs / "launch_run",
            "failing_workdir": smoke_root / "failing", "report": json.loads((smoke_root / "smoke.json").read_text())}
