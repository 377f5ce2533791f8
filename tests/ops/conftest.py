"""Shared by the preflight and smoke tests: the real console script, a tree digest proving a
refused command wrote nothing, the demo corpus, and one smoke run of the tiny pretraining
config whose checkpoint the preflight cases use as a source."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.launch_utils import REPO, base_env

VENV_BIN = Path(sys.executable).parent


def ds_trhash(*args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    """`ds-trhash ...` as a user runs it, from the repository root."""
    return subprocess.run([str(VENV_BIN / "ds-trhash"), *map(str, args)], cwd=REPO, env=base_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` with the SHA-256 of its bytes ("dir" for folders)."""
    out = {}
    for path in sorted(Path(root).rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The demo corpus (tokenizer, shards, pretraining and refinement plans), its SFT set, and
    the same corpus under another tokenizer (vocabulary 4000)."""
    from ds_trhash.data.embedded import build_embedded
    from ds_trhash.data.sft_build import build_sft_dataset

    root = tmp_path_factory.mktemp("corpus")
    paths = build_embedded(root / "data", seq_len=128)
    build_sft_dataset(paths.chat_train_jsonl, paths.chat_eval_jsonl, paths.tokenizer_dir, 128, root / "sft")
    other = build_embedded(root / "data_other_tokenizer", seq_len=128, vocab_size=4000)
    return {"root": root, "paths": paths, "sft": root / "sft", "other": other}


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`ds-trhash smoke` of ds_configs/tiny/pretrain.yaml, 4 steps, work directory kept."""
    root = tmp_path_factory.mktemp("smoke")
    workdir, report = root / "work", root / "smoke.json"
    proc = ds_trhash("smoke", "--config", "ds_configs/tiny/pretrain.yaml", "--steps", "4",
                     "--workdir", workdir, "--json", report, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {"proc": proc, "report": json.loads(report.read_text()), "workdir": workdir,
            "checkpoint": workdir / "run" / "checkpoints" / "step_00000004"}
