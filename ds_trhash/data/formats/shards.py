"""Text -> little-endian uint16 token shards, with a per-source manifest.

The manifest we write is a superset of the release's source manifest (docs/contracts.md §2b):
its format ``tr-hash-token-mixture-v1`` and fields, plus our tokenizer identity
(``tokenizer_sha256``, ``vocab_size``) and the stream counts. Manifests written before
(``tr-hash-token-shards-v1``) keep loading; ``data/manifest.py`` validates both.

Stream layout (docs/contracts.md §2): documents are tokenized and joined into one stream, each followed
by EOS (id 0). Shard k holds ``rows·L + 1`` tokens, stream positions
``[k·R·L, k·R·L + rows·L + 1)`` for R rows per shard: the stream advances by ``R·L`` per
shard, so the last token of a shard is repeated as the first token of the next. That way
every stream token after the first is a label exactly once, and each shard stays
self-contained (row r = tokens ``[r·L, r·L + L]``, no reads across files).

Whatever does not complete a row at the end of the stream is dropped and counted in the
manifest's ``dropped_tokens``; nothing is ever padded.

Plain-text inputs hold one document per blank-line-separated block (streams without
reading a whole file; paragraphs of a book become separate documents joined by EOS).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from tokenizers import Tokenizer

from ds_trhash.io import json_text, publish_dir
from ds_trhash.safe_names import UnsafeNameError, bare_name

from ds_trhash.data.formats.layout import load_any, read_source_manifest
from ds_trhash.data.formats.manifest import DTYPE, MIXTURE_FORMAT, SOURCE_MANIFEST, ShardError, SourceManifest
from ds_trhash.data.formats.tokenizer import EOS_ID, PathLike, load_tokenizer, tokenizer_sha256

SHARD_FORMAT = MIXTURE_FORMAT  # what the writer writes; LEGACY_FORMAT manifests still load
MANIFEST_FILE = SOURCE_MANIFEST
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKEN_ID = int(np.iinfo(np.uint16).max)
_ENCODE_BATCH = 256


def check_source_name(name: str) -> str:
    """Source names become directory names and plan keys, so they must be plain (the one rule of
    ``safe_names.bare_name``)."""
    try:
        return bare_name(name, "source name")
    except UnsafeNameError as exc:
        raise ShardError(f"{exc}; use letters, digits, '_', '-', '.' (not leading '.')") from None


class _ShardWriter:
    """Fills one shard-sized buffer and writes it out, carrying the boundary token over."""

    def __init__(self, directory: Path, seq_len: int, rows_per_shard: int) -> None:
        self.directory = directory
        self.seq_len = seq_len
        self.capacity = rows_per_shard * seq_len + 1
        self.buffer = np.empty(self.capacity, dtype=TOKEN_DTYPE)
        self.filled = 0
        self.stream_tokens = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        self.stream_tokens += len(tokens)
        start = 0
        while start < len(tokens):
            take = min(self.capacity - self.filled, len(tokens) - start)
            self.buffer[self.filled : self.filled + take] = tokens[start : start + take]
            self.filled += take
            start += take
            if self.filled == self.capacity:
                self._write(self.capacity)
                self.buffer[0] = self.buffer[self.capacity - 1]
                self.filled = 1

    def finish(self) -> int:
        """Write the trailing partial shard (whole rows only); return the dropped token count."""
        rows = (self.filled - 1) // self.seq_len if self.filled else 0
        if rows:
            self._write(rows * self.seq_len + 1)
        total_rows = sum(shard["rows"] for shard in self.shards)
        used = total_rows * self.seq_len + 1 if total_rows else 0
        return self.stream_tokens - used

    def _write(self, count: int) -> None:
        name = f"shard-{len(self.shards):05d}.bin"
        data = self.buffer[:count].tobytes()
        (self.directory / name).write_bytes(data)
        self.shards.append(
            {
                "file": name,
                "rows": (count - 1) // self.seq_len,
                "tokens": count,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )


def _document_ids(tokenizer: Tokenizer, texts: Iterable[str]) -> Iterator[np.ndarray]:
    """Yield each document's ids followed by EOS, encoding in batches for speed."""
    batch: list[str] = []
    for text in texts:
        if not isinstance(text, str):
            raise ShardError(f"a document is {type(text).__name__}, expected str")
        batch.append(text)
        if len(batch) == _ENCODE_BATCH:
            yield from _encode(tokenizer, batch)
            batch = []
    yield from _encode(tokenizer, batch)


def _encode(tokenizer: Tokenizer, texts: list[str]) -> Iterator[np.ndarray]:
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []:
        yield np.append(np.asarray(encoding.ids, dtype=np.int64), EOS_ID)


def _check_shard_settings(source_name: str, seq_len: int, rows_per_shard: int, vocab_size: int) -> None:
    check_source_name(source_name)
    if seq_len < 1 or rows_per_shard < 1:
        raise ShardError(f"seq_len ({seq_len}) and rows_per_shard ({rows_per_shard}) must be positive")
    if not 0 < vocab_size <= MAX_TOKEN_ID + 1:
        raise ShardError(f"vocab_size {vocab_size} does not fit uint16 shards (at most {MAX_TOKEN_ID + 1})")


def _write_documents(writer: _ShardWriter, documents: Iterable[np.ndarray], source_name: str, vocab_size: int) -> int:
    """Every document into ``writer``, each checked against ``vocab_size``: the number written."""
    count = 0
    for ids in documents:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids[(ids >= vocab_size) | (ids < 0)][0])
            raise ShardError(
                f"document {count} of source {source_name!r} has token id {bad}, outside [0, {vocab_size}) "
                "(vocab_size; uint16 shards hold at most 65536 ids); use a tokenizer matching vocab_size"
            )
        writer.add(ids)
        count += 1
    return count


def _source_manifest(writer: _ShardWriter, source_name: str, seq_len: int, rows_per_shard: int, vocab_size: int,
                     tokenizer_hash: str, documents: int, dropped: int) -> dict:
    total_rows = sum(shard["rows"] for shard in writer.shards)
    return {
        # the release's source-manifest fields ...
        "format": SHARD_FORMAT,
        "source": source_name,
        "weight": 1.0,  # a mixture weight; one tokenized source on its own weighs 1
        "seq_len": seq_len,
        "dtype": DTYPE,
        "rows": total_rows,
        "trained_tokens": total_rows * seq_len,
        "source_tokens_consumed": writer.stream_tokens - dropped,
        # ... and ours
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_hash,
        "rows_per_shard": rows_per_shard,
        "documents": documents,
        "stream_tokens": writer.stream_tokens,
        "dropped_tokens": dropped,
        "total_rows": total_rows,
        "shards": writer.shards,
    }


def write_shards(
    source_name: str,
    documents: Iterable[np.ndarray],
    seq_len: int,
    rows_per_shard: int,
    out_dir: PathLike,
    vocab_size: int,
    tokenizer_hash: str,
) -> dict:
    """Write already-tokenized documents (each ending with its EOS) as shards + manifest.

    The source directory is built under a temporary name and renamed at the end, so a
    crash never leaves a directory that looks complete.
    """
    _check_shard_settings(source_name, seq_len, rows_per_shard, vocab_size)
    final_dir = Path(out_dir) / source_name
    if final_dir.exists():
        raise ShardError(f"{final_dir} already exists; shards are immutable, delete it or choose another --out")
    tmp_dir = Path(out_dir) / f".{source_name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        writer = _ShardWriter(tmp_dir, seq_len, rows_per_shard)
        count = _write_documents(writer, documents, source_name, vocab_size)
        dropped = writer.finish()
        if not writer.shards:
            raise ShardError(
                f"source {source_name!r} has {writer.stream_tokens} tokens, fewer than one row of "
                f"{seq_len + 1}; add text or lower seq_len"
            )
        manifest = _source_manifest(writer, source_name, seq_len, rows_per_shard, vocab_size, tokenizer_hash,
                                    count, dropped)
        (tmp_dir / MANIFEST_FILE).write_text(json_text(manifest), encoding="utf-8")
        publish_dir(tmp_dir, final_dir, replace=False, fsync=False)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest


def tokenize_to_shards(
    source_name: str,
    texts_iter: Iterable[str],
    tokenizer: PathLike,
    seq_len: int,
    rows_per_shard: int,
    out_dir: PathLike,
    vocab_size: int,
) -> dict:
    """Tokenize a source into ``<out_dir>/<source>/shard-NNNNN.bin`` plus ``manifest.json``.

    ``tokenizer`` is the tokenizer directory or file: its bytes' hash goes into the manifest,
    which a loaded tokenizer object could not provide.
    """
    loaded = load_tokenizer(tokenizer)
    return write_shards(
        source_name, _document_ids(loaded, texts_iter), seq_len, rows_per_shard, out_dir, vocab_size,
        tokenizer_sha256(tokenizer),
    )


def load_manifest(path: PathLike) -> SourceManifest:
    """A source manifest (either format, validated) from its file or the source folder holding it."""
    return read_source_manifest(path)


def load_manifests(paths: Sequence[PathLike]) -> dict[str, SourceManifest]:
    """Manifests by source from manifest files, source folders, or corpus roots of either layout
    (ours: folders each holding one source's manifest; the release's: a mixture_manifest.json)."""
    return load_any(paths)


def read_jsonl_texts(paths: Sequence[PathLike], text_field: str = "text") -> Iterator[str]:
    """Yield the text field of every JSONL record; empty texts are skipped."""
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ShardError(f"{path}:{number} is not valid JSON: {exc}") from exc
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ShardError(f"{path}:{number} has no string field {text_field!r}; set --text-field")
                if text:
                    yield text


def read_text_documents(paths: Sequence[PathLike]) -> Iterator[str]:
    """Yield one document per blank-line-separated block of each plain-text file."""
    for path in paths:
        block: list[str] = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    block.append(line.rstrip("\n"))
                elif block:
                    yield "\n".join(block)
                    block = []
        if block:
            yield "\n".join(block)


def read_rows(shard_path: PathLike, rows: Sequence[int], seq_len: int) -> np.ndarray:
    """Return the windows of the given rows as int64 ``[len(rows), seq_len + 1]``.

    Memory-mapped, so only the pages of the requested rows are read.
    """
    tokens = np.memmap(shard_path, dtype=TOKEN_DTYPE, mode="r")
    if len(tokens) < seq_len + 1 or (len(tokens) - 1) % seq_len:
        raise ShardError(f"{shard_path} holds {len(tokens)} tokens, not rows·{seq_len}+1; wrong seq_len or damaged shard")
    available = (len(tokens) - 1) // seq_len
    out = np.empty((len(rows), seq_len + 1), dtype=np.int64)
    for index, row in enumerate(rows):
        if not 0 <= row < available:
            raise ShardError(f"row {row} is outside {shard_path}, which has {available} rows")
        out[index] = tokens[row * seq_len : row * seq_len + seq_len + 1]
    del tokens
    return out


def read_row(shard_path: PathLike, row: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of one row: the window's first L tokens and the L after the first."""
    window = read_rows(shard_path, [row], seq_len)[0]
    return window[:-1], window[1:]
