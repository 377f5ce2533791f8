"""A small byte-level BPE tokenizer and chat JSONL writers shared by the SFT tests.

The tokenizer has the release's special-token layout (`</s>`=0, `<pad>`=1, `<s>`=2,
`<unk>`=3) but only 512 entries, trained offline on the Python help topics, so tests
exercise real BPE merges without any download.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

SPECIAL_TOKENS = ["</s>", "<pad>", "<s>", "<unk>"]
VOCAB_SIZE = 512


def build_test_tokenizer(out_dir: Path) -> Path:
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = [line for text in list(topics.values())[:40] for line in text.splitlines() if line.strip()][:600]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return build_test_tokenizer(tmp_path_factory.mktemp("sft_tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


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
