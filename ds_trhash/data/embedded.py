"""A tiny, fully offline demo corpus built from text shipped with Python.

``pydoc_data.topics`` (the language reference topics behind ``help()``) is the only input,
so the demo and the tests need no download. From it this module makes a tokenizer, shards
for two sources, a pretraining plan with a replay phase, its refinement plan, and small
chat sets. Every conversation fits ``seq_len`` tokens under the complexity-chat-v2 layout
(docs/contracts.md §5), so an SFT build at the demo length never hits the no-truncation gate.

Each build lives in its own directory named by the hash of everything that determines its
content (format, seq_len, vocabulary, seed, Python's topics): a run reading one corpus never
sees it rebuilt under it, and a different request gets a different directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ds_trhash.errors import UserError
from ds_trhash.io import publish_dir, sha256_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer

from ds_trhash.data.plans.plan import derive_refinement, write_plan
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.formats.shards import tokenize_to_shards
from ds_trhash.data.formats.tokenizer import PathLike, load_tokenizer, train_tokenizer

STAMP_FILE = "EMBEDDED_STAMP.json"
STAMP_FORMAT = "ds-trhash-embedded-v1"
SOURCES = ("topics_a", "topics_b")
SOURCE_PASSES = {"topics_a": 2, "topics_b": 1}
ROWS_PER_SHARD = 64
ROW_ALIGNMENT = 8
SYSTEM_PROMPT = "You answer questions about Python."
TRAIN_CONVERSATIONS, EVAL_CONVERSATIONS = 300, 40
_ANSWER_CHARS = 220
# Tokens kept free below seq_len: prompt and completion are tokenized apart in SFT, which can
# cost a token or two at the boundary.
_CHAT_MARGIN = 8
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class EmbeddedError(UserError, ValueError):
    """The demo corpus cannot be built with the requested settings."""


@dataclass(frozen=True)
class EmbeddedPaths:
    root: Path
    tokenizer_dir: Path
    shards_dir: Path
    pretrain_plan: Path
    refine_plan: Path
    chat_train_jsonl: Path
    chat_eval_jsonl: Path

    @classmethod
    def under(cls, root: Path) -> "EmbeddedPaths":
        return cls(
            root=root,
            tokenizer_dir=root / "tokenizer",
            shards_dir=root / "shards",
            pretrain_plan=root / "plans" / "pretrain.json",
            refine_plan=root / "plans" / "refine.json",
            chat_train_jsonl=root / "chat" / "train.jsonl",
            chat_eval_jsonl=root / "chat" / "eval.jsonl",
        )

    def files(self) -> list[Path]:
        return [self.tokenizer_dir / "tokenizer.json", self.pretrain_plan, self.refine_plan,
                self.chat_train_jsonl, self.chat_eval_jsonl]


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {key: topics[key] for key in sorted(topics)}


def _topics_sha256(topics: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(topics, sort_keys=True).encode("utf-8")).hexdigest()


# -- chat data ------------------------------------------------------------------------
def _title(key: str, text: str) -> str:
    lines = text.lstrip("\n").splitlines()
    if len(lines) > 1 and lines[1] and set(lines[1].strip()) <= set("*=-"):
        title = lines[0].strip()
        return "the" + title[3:] if title.startswith("The ") else title
    return key.replace("-", " ")


def _prose(text: str) -> list[str]:
    """Paragraphs of running text: no headings, no indented code, no grammar rules."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue
        if any(set(line.strip()) <= set("*=-") for line in lines) or "::=" in block:
            continue
        paragraph = " ".join(line.strip() for line in lines)
        if len(paragraph) >= 60 and paragraph[-1] in ".:":
            out.append(paragraph)
    return out


def _answer(sentences: list[str]) -> str:
    """At most two sentences, and only the first when two run long."""
    answer = " ".join(sentences[:2])
    return answer if len(answer) <= _ANSWER_CHARS else sentences[0]


def _conversations(topics: dict[str, str]) -> Iterator[list[dict]]:
    def system() -> dict:
        return {"role": "system", "content": SYSTEM_PROMPT}

    for key, text in topics.items():
        title, paragraphs = _title(key, text), _prose(text)
        if not paragraphs:
            continue
        question = f"What does the Python reference say about {title}?"
        first = _answer(_SENTENCE_END.split(paragraphs[0]))
        yield [system(), {"role": "user", "content": question}, {"role": "assistant", "content": first}]
        if len(paragraphs) > 1:
            more = _answer(_SENTENCE_END.split(paragraphs[1]))
            yield [system(), {"role": "user", "content": question}, {"role": "assistant", "content": first},
                   {"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": more}]
        for paragraph in paragraphs[1:]:
            sentences = _SENTENCE_END.split(paragraph)
            if len(sentences) < 2:
                continue
            prompt = f'In the Python reference on {title}, what follows "{sentences[0]}"?'
            yield [system(), {"role": "user", "content": prompt}, {"role": "assistant", "content": _answer(sentences[1:])}]


def demo_conversations() -> list[list[dict]]:
    """Every conversation the demo chat sets are drawn from (before the length filter and split)."""
    return list(_conversations(_topics()))


def _chat_tokens(tokenizer: Tokenizer, messages: list[dict]) -> int:
    """Token count under the complexity-chat-v2 layout (role headers, EOS per assistant turn)."""
    text = "".join(f"{m['role'].capitalize()}:\n{m['content'].strip()}\n\n" for m in messages)
    return len(tokenizer.encode(text).ids) + sum(m["role"] == "assistant" for m in messages)


def _chat_sets(topics: dict[str, str], tokenizer: Tokenizer, seq_len: int, seed: int) -> tuple[list, list]:
    pool, seen = [], set()
    for messages in _conversations(topics):
        identity = json.dumps(messages, sort_keys=True)
        if identity not in seen and _chat_tokens(tokenizer, messages) <= seq_len - _CHAT_MARGIN:
            seen.add(identity)
            pool.append(messages)
    random.Random(seed).shuffle(pool)
    if len(pool) < TRAIN_CONVERSATIONS + EVAL_CONVERSATIONS:
        raise EmbeddedError(
            f"only {len(pool)} demo conversations fit {seq_len} tokens; use a larger seq_len for the embedded corpus"
        )
    evaluation = pool[:EVAL_CONVERSATIONS]
    train = pool[EVAL_CONVERSATIONS : EVAL_CONVERSATIONS + TRAIN_CONVERSATIONS]
    return train, evaluation


def _write_jsonl(path: Path, conversations: list[list[dict]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for messages in conversations:
            handle.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


# -- build ----------------------------------------------------------------------------
def _stamp(seq_len: int, vocab_size: int, seed: int, topics_sha256: str) -> dict:
    return {"format": STAMP_FORMAT, "seq_len": seq_len, "vocab_size": vocab_size, "seed": seed,
            "python": platform.python_version(), "topics_sha256": topics_sha256}


def _is_complete(paths: EmbeddedPaths, stamp: dict) -> bool:
    stamp_file = paths.root / STAMP_FILE
    if not stamp_file.is_file():
        return False
    recorded = json.loads(stamp_file.read_text(encoding="utf-8"))
    if {key: recorded.get(key) for key in stamp} != stamp:
        return False
    for relative, digest in recorded.get("files", {}).items():
        file = paths.root / relative
        if not file.is_file() or sha256_file(file) != digest:
            return False
    return bool(recorded.get("files"))


def _build(root: Path, seq_len: int, vocab_size: int, seed: int, topics: dict[str, str], stamp: dict) -> None:
    paths = EmbeddedPaths.under(root)
    train_tokenizer(list(topics.values()), vocab_size, paths.tokenizer_dir)
    keys = list(topics)
    halves = {SOURCES[0]: keys[: len(keys) // 2], SOURCES[1]: keys[len(keys) // 2 :]}
    manifests = {
        source: tokenize_to_shards(source, (topics[k] for k in members), paths.tokenizer_dir, seq_len,
                                   ROWS_PER_SHARD, paths.shards_dir, vocab_size)
        for source, members in halves.items()
    }
    available = sum(m["total_rows"] for m in manifests.values()) * seq_len
    pretrain = build_plan(
        manifests, available, dataset="pydoc_data.topics", revision=f"python-{stamp['python']}-{stamp['topics_sha256'][:12]}",
        source_passes=SOURCE_PASSES, row_alignment=ROW_ALIGNMENT, seq_len=seq_len,
    )
    write_plan(pretrain, paths.pretrain_plan)
    write_plan(derive_refinement(pretrain), paths.refine_plan)
    train, evaluation = _chat_sets(topics, load_tokenizer(paths.tokenizer_dir), seq_len, seed)
    _write_jsonl(paths.chat_train_jsonl, train)
    _write_jsonl(paths.chat_eval_jsonl, evaluation)
    files = {str(f.relative_to(root)): sha256_file(f) for f in paths.files()}
    (root / STAMP_FILE).write_text(json.dumps({**stamp, "files": files}, indent=2) + "\n", encoding="utf-8")


def corpus_key(stamp: dict) -> str:
    """The directory name of one corpus: a hash of what determines its bytes."""
    return "corpus-" + hashlib.sha256(json.dumps(stamp, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def build_embedded(out_dir: PathLike, seq_len: int = 128, vocab_size: int = 4096, seed: int = 0) -> EmbeddedPaths:
    """Build (or reuse) the embedded demo corpus in ``out_dir/corpus-<hash>/``.

    Built in a sibling temporary directory and renamed into place, so concurrent callers and
    crashes never see a half-built corpus. An existing corpus is never replaced: if its files
    no longer match its stamp it is refused (another run may be reading it) and left as it is.
    """
    topics = _topics()
    stamp = _stamp(seq_len, vocab_size, seed, _topics_sha256(topics))
    root = Path(out_dir) / corpus_key(stamp)
    paths = EmbeddedPaths.under(root)
    if _is_complete(paths, stamp):
        return paths
    if root.exists():
        raise EmbeddedError(
            f"the embedded demo corpus {root} is damaged (its files do not match {STAMP_FILE}); it is left "
            "untouched in case a run reads it: remove that directory once no run uses it, then launch again")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _build(tmp, seq_len, vocab_size, seed, topics, stamp)
        try:
            os.rename(tmp, root)  # fails when another process finished first: keep theirs
        except OSError:
            if not _is_complete(paths, stamp):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths
