"""The resumable work directory of one `data tokenize` run (or of one ``--part i/K`` of it).

The record stream is cut by record index into fixed-size chunks (``chunk_records`` records each,
whatever the worker count), so chunk ``n`` always holds the same documents. A tokenized chunk is
one file ``c-<n>.bin`` (the documents' lengths as little-endian uint32, then their tokens, each
document ending with EOS, as little-endian uint16) and its completion record ``c-<n>.json``
(sizes, SHA-256, per-input counts, the bad records), written after the data file, each by an
atomic rename. A chunk counts as done only when its record exists and the data file hashes to it.

``run.json`` holds what determines the output (inputs, tokenizer, seq_len, rows_per_shard,
vocab_size, text field, chunk size, part); a run over a work directory made with other values
is refused, naming each that differs. ``done.json`` marks a work directory that saw the end of
its input. Only chunks a part owns (``n % K == i``) are in its directory.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ds_trhash.io import read_json_object, remove_dir, sha256_file, write_json_atomic

from ds_trhash.data.formats.shards import TOKEN_DTYPE, ShardError

RUN_FORMAT = "tr-hash-tokenize-run-v1"
RUN_FILE, DONE_FILE = "run.json", "done.json"
LENGTH_DTYPE = np.dtype("<u4")


class WorkDirError(ShardError):
    """A work directory does not belong to this command, or a chunk in it is damaged."""


def chunk_name(index: int) -> str:
    return f"c-{index:08d}"


def differences(old: dict, new: dict, old_name: str = "partial run", new_name: str = "this command") -> list[str]:
    """``key: old (old_name) vs new (new_name)`` for each top-level key that differs; for the input
    list, the first input that differs (a corpus may have thousands)."""
    out = []
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if was == now:
            continue
        if key == "inputs" and isinstance(was, list) and isinstance(now, list):
            if len(was) != len(now):
                out.append(f"inputs: {len(was)} ({old_name}) vs {len(now)} ({new_name})")
                continue
            index = next(i for i, (a, b) in enumerate(zip(was, now)) if a != b)
            key, was, now = f"input {index}", was[index], now[index]
        out.append(f"{key}: {was!r} ({old_name}) vs {now!r} ({new_name})")
    return out


class ChunkStore:
    """One work directory: its identity, its verified chunks, its completion marker."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # ------------------------------------------------------------------ identity

    def identity(self) -> dict:
        return read_json_object(self.root / RUN_FILE, WorkDirError,
                                missing=f"{self.root} is not a tokenize work directory")

    def claim(self, identity: dict) -> None:
        """Create the directory for ``identity``, or check that an existing one was made with it."""
        run_file = self.root / RUN_FILE
        if run_file.exists():
            found = self.identity()
            diff = differences(found, identity)
            if diff:
                raise WorkDirError(
                    f"{self.root} holds a partial run made with other arguments ({'; '.join(diff)}); "
                    f"run the same command again to continue it, or delete {self.root} to start over")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_file, identity, fsync=False)

    # ------------------------------------------------------------------ chunks

    def record(self, index: int) -> Optional[dict]:
        path = self.root / f"{chunk_name(index)}.json"
        return read_json_object(path, WorkDirError) if path.is_file() else None

    def verified(self, index: int) -> Optional[dict]:
        """The chunk's completion record if its data file is whole, else None (also for a record
        torn by a power loss: the files are not fsynced, the hashes catch what did not reach disk)."""
        try:
            record = self.record(index)
        except WorkDirError:
            return None
        data = self.root / f"{chunk_name(index)}.bin"
        if record is None or not data.is_file() or data.stat().st_size != record["bytes"]:
            return None
        return record if sha256_file(data) == record["sha256"] else None

    def write(self, index: int, lengths: np.ndarray, tokens: np.ndarray, info: dict) -> dict:
        """Store one tokenized chunk: data file first, then its completion record."""
        payload = np.asarray(lengths, dtype=LENGTH_DTYPE).tobytes() + np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()
        name = chunk_name(index)
        tmp = self.root / f".{name}.bin.tmp"
        tmp.write_bytes(payload)
        os.replace(tmp, self.root / f"{name}.bin")
        record = {"chunk": index, "documents": int(len(lengths)), "tokens": int(len(tokens)), "bytes": len(payload),
                  "sha256": hashlib.sha256(payload).hexdigest(), **info}
        write_json_atomic(self.root / f"{name}.json", record, fsync=False)
        return record

    def documents(self, index: int) -> Iterator[np.ndarray]:
        """The chunk's documents (each ending with EOS), checked against its completion record."""
        record = self.record(index)
        if record is None:
            raise WorkDirError(f"{self.root} lacks chunk {index}; run that part again to complete it")
        data = (self.root / f"{chunk_name(index)}.bin").read_bytes()
        if len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise WorkDirError(f"{self.root / chunk_name(index)}.bin does not match its record (damaged); "
                               "delete the chunk's .json and run that part again")
        split = record["documents"] * LENGTH_DTYPE.itemsize
        lengths = np.frombuffer(data[:split], dtype=LENGTH_DTYPE)
        tokens = np.frombuffer(data[split:], dtype=TOKEN_DTYPE)
        bounds = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        for start, end in zip(bounds[:-1], bounds[1:]):
            yield tokens[start:end]

    # ------------------------------------------------------------------ completion

    def done(self) -> Optional[dict]:
        path = self.root / DONE_FILE
        return read_json_object(path, WorkDirError) if path.is_file() else None

    def mark_done(self, summary: dict) -> None:
        write_json_atomic(self.root / DONE_FILE, summary, fsync=False)

    def remove(self) -> None:
        """Delete the work directory once its chunks live on as shards."""
        remove_dir(self.root)
