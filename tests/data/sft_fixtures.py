"""A small byte-level BPE tokenizer and chat JSONL writers shared by the SFT tests.

The tokenizer comes from the project's trainer (release special-token layout) with only
512 entries, trained offline on the Python help topics, so tests exercise real BPE merges
without any download.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_trhash.data.formats.tokenizer import load_tokenizer, train_tokenizer

VOCAB_SIZE = 512


def build_test_tokenizer(out_dir: Path) -> Path:
    from pydoc_data.topics import topics

    lines = [line for text in list(topics.values())[:40] for line in text.splitlines() if line.strip()][:600]
    return train_tokenizer(lines, VOCAB_SIZE, out_dir).parent


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("sft_tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def conversation(i: int, turns: int = 1, system: str | None = None) -> list[dict]:
    """A deterministic conversation with `turns` user/assistant exchanges and varied lengths."""
    messages = [{"role": "system", "content": system}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: what does the for statement do?"})
        messages.append({"role": "assistant", "content": "It iterates over a sequence. " * (1 + (i + t) % 4)})
    return messages


def write_jsonl(path: Path, records: list) -> Path:
    """Records are dicts (written as JSON) or raw strings (written verbatim, e.g. broken JSON)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record if isinstance(record, str) else json.dumps(record))
            f.write("\n")
    return path
