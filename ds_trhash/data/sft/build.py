"""Chat JSONL -> audited, tokenized SFT set with a fail-closed manifest (docs/contracts.md §5).

The build is all-or-nothing: every invalid conversation is reported (file:line, reason) and
the build fails leaving no output, unless `drop_invalid` is set, in which case invalid
records are skipped and counted by reason in the manifest. Nothing is ever truncated: an
example longer than the sequence cap is invalid. Output is written into a temporary sibling
directory, `manifest.json` last, and renamed into place, so a directory with a manifest is
always complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ds_trhash.data.sft.chat import (
    CHAT_TEMPLATE_ID,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    SUPERVISION_MODES,
    TEMPLATE_DESCRIPTION,
    ChatError,
    Example,
    tokenize_example,
)
from ds_trhash.data.formats.tokenizer import TokenizerError, load_tokenizer, tokenizer_file, tokenizer_sha256
from ds_trhash import outputs
from ds_trhash.errors import UserError
from ds_trhash.io import publish_dir, sha256_file, utf8_lines, write_json

MANIFEST_FORMAT = "tr-hash-sft-manifest-v1"
INDEX_FORMAT = "tr-hash-sft-bin-v1"
PARTITIONS = ("train", "eval")
PARTITION_FILES = ("input_ids.bin", "labels.bin", "examples.jsonl", "sft.idx.json")
INPUT_DTYPE = "<u4"
LABEL_DTYPE = "<i4"
TOKENIZER_FILE = "tokenizer/tokenizer.json"
TEMPLATE_FILE = "chat_template.json"
MANIFEST_FILE = "manifest.json"
DEFAULT_CAPABILITY = "general"
MAX_LISTED_ERRORS = 20


class SFTBuildError(UserError, ValueError):
    """The SFT set cannot be built; the message lists what is wrong and how to fix it."""


class InvalidExamples(SFTBuildError):
    """Examples the builder refuses: the first line says what to do, then one line per example."""

    def message_lines(self) -> list[str]:
        return [line.rstrip() for line in str(self).splitlines() if line.strip()]


def load_tokenizer_identity(path_or_dir: str | os.PathLike) -> tuple[Tokenizer, str]:
    """(tokenizer, tokenizer hash); the hash is the identity checked against the model's
    tokenizer at training time, so the build and that check both come through here."""
    try:
        return load_tokenizer(path_or_dir), tokenizer_sha256(path_or_dir)
    except TokenizerError as err:  # unreadable file or wrong special-token ids
        raise SFTBuildError(f"cannot use the tokenizer at {path_or_dir}: {err}") from None


@dataclass(frozen=True)
class InvalidRecord:
    file: str
    line: int
    code: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class PartitionStats:
    source: dict
    examples: int = 0
    num_tokens: int = 0
    supervised_tokens: int = 0
    max_example_tokens: int = 0
    dropped: Counter = field(default_factory=Counter)

    def add(self, example: Example) -> None:
        self.examples += 1
        self.num_tokens += example.num_tokens
        self.supervised_tokens += example.supervised_tokens
        self.max_example_tokens = max(self.max_example_tokens, example.num_tokens)


def _parse_record(line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ChatError("invalid_json", f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict) or "messages" not in record:
        raise ChatError("missing_messages", 'a record must be a JSON object with a "messages" list')
    return record


def _tokenize_record(record: dict, tokenizer: Tokenizer, seq_len: int, vocab_size: int) -> Example:
    example = tokenize_example(record["messages"], tokenizer)
    if example.num_tokens > seq_len:
        raise ChatError("too_long", f"{example.num_tokens} tokens exceed the sequence cap {seq_len}; examples are never truncated: shorten or split the conversation, or raise --seq-len")
    top = max(example.input_ids + example.labels)
    if top >= vocab_size:
        raise ChatError("token_out_of_vocab", f"token id {top} is outside the vocabulary of {vocab_size}; the tokenizer does not match the model")
    return example


def _write_partition(out: Path, name: str, source: Path, source_name: str, tokenizer: Tokenizer, seq_len: int,
                     vocab_size: int, invalid: list[InvalidRecord]) -> PartitionStats:
    if not source.is_file():
        raise SFTBuildError(f"{name} input {source} does not exist; pass a chat JSONL file")
    out.mkdir()
    stats = PartitionStats(source={"partition": name, "name": source_name, "file": source.name, "sha256": sha256_file(source)})
    with open(out / "input_ids.bin", "wb") as ids_f, \
            open(out / "labels.bin", "wb") as labels_f, open(out / "examples.jsonl", "w", encoding="utf-8") as index_f:
        for line_no, line in enumerate(utf8_lines(source, SFTBuildError), start=1):
            if not line.strip():
                continue
            try:
                record = _parse_record(line)
                example = _tokenize_record(record, tokenizer, seq_len, vocab_size)
            except ChatError as err:
                invalid.append(InvalidRecord(source.name, line_no, err.code, str(err)))
                stats.dropped[err.code] += 1
                continue
            ids_f.write(np.asarray(example.input_ids, dtype=INPUT_DTYPE).tobytes())
            labels_f.write(np.asarray(example.labels, dtype=LABEL_DTYPE).tobytes())
            entry = {
                "example_id": f"{name}-{stats.examples:08d}",
                "offset": stats.num_tokens,
                "num_tokens": example.num_tokens,
                "supervised_tokens": example.supervised_tokens,
                "source": record.get("source") if isinstance(record.get("source"), str) else source_name,
                "capability": record.get("capability") if isinstance(record.get("capability"), str) else DEFAULT_CAPABILITY,
                "line": line_no,
            }
            index_f.write(json.dumps(entry, ensure_ascii=False) + "\n")
            stats.add(example)
    write_json(out / "sft.idx.json", {
        "format": INDEX_FORMAT,
        "examples": stats.examples,
        "num_tokens": stats.num_tokens,
        "supervised_tokens": stats.supervised_tokens,
        "max_example_tokens": stats.max_example_tokens,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "vocab_size": vocab_size,
        "chat_template": CHAT_TEMPLATE_ID,
        "input_dtype": INPUT_DTYPE,
        "label_dtype": LABEL_DTYPE,
        "pre_shifted": True,
    }, fsync=False)
    return stats


def _invalid_listing(invalid: list[InvalidRecord]) -> str:
    lines = [f"{len(invalid)} invalid SFT example(s): fix or remove them, or rebuild with --drop-invalid to skip "
             "them (they are then counted in the manifest); one per line below"]
    lines += [f"  {item}" for item in invalid[:MAX_LISTED_ERRORS]]
    if len(invalid) > MAX_LISTED_ERRORS:
        lines.append(f"  ... and {len(invalid) - MAX_LISTED_ERRORS} more")
    return "\n".join(lines)


def _check_vocab(tokenizer: Tokenizer, vocab_size: int | None) -> int:
    """The vocabulary recorded for the set; the shared loader already checked the special ids."""
    size = tokenizer.get_vocab_size()
    if vocab_size is not None and size > vocab_size:
        raise SFTBuildError(f"the tokenizer has {size} entries but the vocabulary size is {vocab_size}; pass the model's vocabulary size or its tokenizer")
    return size if vocab_size is None else vocab_size


def _check_out_dir(out_dir: Path) -> None:
    outputs.check_dir_target("--out", out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise SFTBuildError(f"output {out_dir} already exists and is not an empty directory; choose a new --out or remove it")


def _publish(tmp: Path, out_dir: Path) -> None:
    _check_out_dir(out_dir)
    if out_dir.exists():
        out_dir.rmdir()
    publish_dir(tmp, out_dir, replace=False, fsync=False)


def _all_files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def build_sft_dataset(train_jsonl: str | os.PathLike, eval_jsonl: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                      seq_len: int, out_dir: str | os.PathLike, drop_invalid: bool = False, source_name: str | None = None,
                      revision: str | None = None, vocab_size: int | None = None) -> dict:
    """Build train/ and eval/ partitions plus the manifest; returns the manifest."""
    if seq_len < 2:
        raise SFTBuildError(f"seq_len must be at least 2, got {seq_len}")
    out_dir = Path(out_dir)
    for flag, source in (("--input", train_jsonl), ("--eval-input", eval_jsonl), ("--tokenizer", tokenizer_dir)):
        outputs.refuse_overlap("--out", out_dir, flag, source)  # a build never writes into what it reads
    _check_out_dir(out_dir)
    tokenizer, tokenizer_hash = load_tokenizer_identity(tokenizer_dir)
    vocab = _check_vocab(tokenizer, vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        invalid: list[InvalidRecord] = []
        stats = {}
        for name, source in zip(PARTITIONS, (Path(train_jsonl), Path(eval_jsonl))):
            stats[name] = _write_partition(tmp / name, name, source, source_name or source.stem, tokenizer, seq_len, vocab, invalid)
        if invalid and not drop_invalid:
            raise InvalidExamples(_invalid_listing(invalid))
        empty = [name for name, s in stats.items() if s.examples == 0]
        if empty:
            raise SFTBuildError(f"no valid example left in partition(s) {', '.join(empty)}; an SFT set needs train and held-out examples")
        (tmp / "tokenizer").mkdir()
        shutil.copyfile(tokenizer_file(tokenizer_dir), tmp / TOKENIZER_FILE)
        write_json(tmp / TEMPLATE_FILE, TEMPLATE_DESCRIPTION, fsync=False)
        manifest = _manifest(stats, tokenizer_hash, tokenizer.get_vocab_size(), vocab, seq_len, revision, drop_invalid, _all_files(tmp))
        write_json(tmp / MANIFEST_FILE, manifest, fsync=False)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _manifest(stats: dict[str, PartitionStats], tokenizer_hash: str, tokenizer_size: int, vocab: int, seq_len: int,
              revision: str | None, drop_invalid: bool, files: dict[str, str]) -> dict:
    dropped = sum((s.dropped for s in stats.values()), Counter())
    return {
        "format": MANIFEST_FORMAT,
        "chat_template": CHAT_TEMPLATE_ID,
        "chat_template_file": TEMPLATE_FILE,
        "supervision": SUPERVISION_MODES[0],
        "pre_shifted": True,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": tokenizer_hash, "vocab_size": tokenizer_size},
        "vocab_size": vocab,
        "seq_len": seq_len,
        "eos": {"token": EOS_TOKEN, "id": EOS_ID},
        "pad": {"token": PAD_TOKEN, "id": PAD_ID},
        "sources": [dict(s.source, revision=revision) for s in stats.values()],
        "partitions": {
            name: {
                "examples": s.examples,
                "num_tokens": s.num_tokens,
                "supervised_tokens": s.supervised_tokens,
                "max_example_tokens": s.max_example_tokens,
                "dropped": dict(sorted(s.dropped.items())),
                "files": {f: files[f"{name}/{f}"] for f in PARTITION_FILES},
            }
            for name, s in stats.items()
        },
        "dropped": {"drop_invalid": drop_invalid, "total": sum(dropped.values()), "by_reason": dict(sorted(dropped.items()))},
        "files": files,
    }
