"""A tiny corpus (our layout) and its plan, served by the loopback Hub stand-in."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants

from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.formats.shards import load_manifests, write_shards
from tests.release.hub_server import HubServer, seed_dataset

TOKEN = "hf_streamtesttoken0123456789abcdef"
REPO = "team/tiny-corpus"
L, R = 8, 4  # seq_len, rows per shard
SHARD_BYTES = (R * L + 1) * 2


def write_corpus(root: Path) -> Path:
    """Two sources of 6 full shards each."""
    for offset, source in ((1, "a"), (500, "b")):
        stream = np.arange(offset, offset + 6 * R * L + 1)
        write_shards(source, [stream], L, R, root, vocab_size=1000, tokenizer_hash="h")
    return root


def corpus_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def plan_for(root: Path, revision: str = "main") -> dict:
    manifests = load_manifests([root])
    return build_plan(manifests, 12 * R * L, dataset=f"hf://datasets/{REPO}", revision=revision)


@pytest.fixture
def hub_corpus(tmp_path, monkeypatch):
    """(hub, local corpus root, plan doc): the same corpus on disk and in the stand-in's repo."""
    root = write_corpus(tmp_path / "corpus")
    with HubServer(TOKEN, deadline_s=300) as hub:
        for key, value in {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        seed_dataset(hub, REPO, corpus_files(root))
        yield hub, root, plan_for(root)
