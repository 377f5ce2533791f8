"""`data tokenize`: parallel, deterministic, resumable tokenization of one source.

How the output stays byte-identical for any worker count and any interruption:

* the parent enumerates the raw records in input order and cuts them, by record index, into
  chunks of ``chunk_records`` (docs/contracts.md §2: the stream is the documents in input order);
* each chunk is decoded and encoded by one of N worker processes, each with its own tokenizer
  instance (separate processes scale, the tokenizers library's own batch threads do not); at most
  ``2·N`` chunks are in flight, so memory stays bounded whatever the corpus size;
* the parent takes results back in chunk order and stores each one in the work directory
  (``chunk_store``), so completed chunks are always a prefix of the chunks this run owns;
* at the end the chunks, in order, are cut into shards by the one shard writer
  (``shards.write_shards``), and the work directory is removed.

A killed run, started again with the same command, verifies the chunks it completed (size and
SHA-256), keeps them, re-reads the input up to that point without tokenizing it, and goes on.
``--part i/K`` owns the chunks ``n`` with ``n % K == i`` and stops at its work directory;
``data merge-parts`` (``parts``) joins the K directories the same way.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
from filelock import FileLock, Timeout

from ds_trhash.data.build.chunk_store import RUN_FORMAT, ChunkStore, WorkDirError
from ds_trhash.data.build.inputs import JSONL, TEXT, InputSpec, Record, Skipped, decode_record, iter_records
from ds_trhash.data.build.parts import BadRecordLimit, join_stores, part_dir, remove_stale_temporaries, work_dir
from ds_trhash.data.formats.shards import MAX_TOKEN_ID, ShardError, check_source_name
from ds_trhash.data.build.tokenize_progress import TokenizeProgress
from ds_trhash.data.formats.tokenizer import EOS_ID, PathLike, load_tokenizer, tokenizer_file, tokenizer_sha256

DEFAULT_CHUNK_RECORDS = 2048


def default_workers() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class TokenizeJob:
    """One `data tokenize` command. ``workers`` and ``max_bad_records`` do not change the output."""

    source: str
    inputs: Sequence[InputSpec]
    tokenizer: PathLike
    seq_len: int
    rows_per_shard: int
    out: Path
    vocab_size: int = 32000
    text_field: str = "text"
    chunk_records: int = DEFAULT_CHUNK_RECORDS
    part: tuple[int, int] = (0, 1)
    workers: int = field(default_factory=default_workers)
    max_bad_records: int = 0

    def check(self) -> None:
        check_source_name(self.source)
        for name in ("seq_len", "rows_per_shard", "chunk_records", "workers"):
            if getattr(self, name) < 1:
                raise ShardError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_bad_records < 0:
            raise ShardError(f"--max-bad-records must be 0 or more, got {self.max_bad_records}")
        if not 0 < self.vocab_size <= MAX_TOKEN_ID + 1:
            raise ShardError(f"--vocab-size {self.vocab_size} does not fit uint16 shards (at most {MAX_TOKEN_ID + 1})")
        index, count = self.part
        if not 0 <= index < count:
            raise ShardError(f"--part {index}/{count}: the index must be in [0, {count}) (parts count from 0)")

    def identity(self) -> dict:
        """Everything that decides the bytes written; a resumed or merged run must match it."""
        return {
            "format": RUN_FORMAT,
            "source": self.source,
            "inputs": [spec.identity() for spec in self.inputs],
            "text_field": self.text_field,
            "tokenizer_sha256": tokenizer_sha256(self.tokenizer),
            "seq_len": self.seq_len,
            "rows_per_shard": self.rows_per_shard,
            "vocab_size": self.vocab_size,
            "chunk_records": self.chunk_records,
            "part": list(self.part),
        }


class ChunkEncoder:
    """Decodes and encodes one chunk of raw records; one instance (and tokenizer) per process."""

    def __init__(self, tokenizer: str, vocab_size: int, text_field: str, labels: Sequence[str]) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = vocab_size
        self.text_field = text_field
        self.labels = list(labels)

    def __call__(self, index: int, records: Sequence[Record]) -> tuple[int, np.ndarray, np.ndarray, dict]:
        lengths: list[int] = []
        flat: list[int] = []
        counts: dict[str, dict[str, int]] = {}
        bad: list[dict] = []
        for record in records:
            tally = counts.setdefault(str(record.source), {"records": 0, "documents": 0, "empty": 0, "bad": 0})
            tally["records"] += 1
            text, reason = decode_record(record, self.text_field)
            if reason is not None:
                tally["bad"] += 1
                bad.append({"at": where(self.labels[record.source], record), "reason": reason})
                continue
            if not text:
                tally["empty"] += 1
                continue
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if ids and max(ids) >= self.vocab_size:
                raise ShardError(
                    f"{where(self.labels[record.source], record)} encodes to token id {max(ids)}, outside "
                    f"[0, {self.vocab_size}) (--vocab-size); use a tokenizer matching the model's vocabulary")
            flat.extend(ids)
            flat.append(EOS_ID)
            lengths.append(len(ids) + 1)
            tally["documents"] += 1
        info = {"records": len(records), "inputs": counts, "bad": bad}
        return index, np.asarray(lengths, dtype=np.uint32), np.asarray(flat, dtype=np.uint16), info


def where(label: str, record: Record) -> str:
    """A record's name for a human: ``FILE line N`` or ``INPUT row N``."""
    return f"{label} {'line' if record.kind in (TEXT, JSONL) else 'row'} {record.number}"


_worker_encoder: Optional[ChunkEncoder] = None


def _init_worker(parent: int, tokenizer: str, vocab_size: int, text_field: str, labels: Sequence[str]) -> None:
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it stops the pool)
    _worker_encoder = ChunkEncoder(tokenizer, vocab_size, text_field, labels)
    threading.Thread(target=_exit_with, args=(parent,), name="orphan-watch", daemon=True).start()


def _exit_with(parent: int) -> None:
    """End this worker once its parent is gone (a ``kill -9`` of the run leaves no orphan behind)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _encode_in_worker(index: int, records: Sequence[Record]) -> tuple[int, np.ndarray, np.ndarray, dict]:
    if _worker_encoder is None:
        raise RuntimeError("a tokenize worker ran before its initializer")
    return _worker_encoder(index, records)


def _chunks(items: Iterator, size: int, wanted: Callable[[int], bool], seen: list) -> Iterator:
    """``(n, records)`` for each wanted chunk ``n`` (records ``[n·size, (n+1)·size)``); ``seen[0]``
    counts every record, wanted or not (``Skipped`` runs lie wholly in unwanted chunks)."""
    batch: list[Record] = []
    current = 0
    for item in items:
        if isinstance(item, Skipped):
            seen[0] += item.count
            continue
        index = seen[0] // size
        seen[0] += 1
        if index != current:
            if batch:
                yield current, batch
            batch, current = [], index
        if wanted(index):
            batch.append(item)
    if batch:
        yield current, batch


def _encode_all(job: TokenizeJob, chunks: Iterator, store: ChunkStore, on_done: Callable[[dict], None]) -> None:
    """Encode chunks in order with ``job.workers`` processes (in this process for one)."""
    args = (str(tokenizer_file(job.tokenizer)), job.vocab_size, job.text_field, [s.label for s in job.inputs])
    if job.workers == 1:
        encoder = ChunkEncoder(*args)
        for index, records in chunks:
            on_done(store.write(*encoder(index, records)))
        return
    # Forked workers: a spawned one would re-run the console script's ``__main__`` and import every
    # command's dependencies (seconds each). The pool forks all its workers on the first submit,
    # which comes before the first record is read, so no reader thread (a streaming dataset's) is
    # forked with them.
    with ProcessPoolExecutor(job.workers, mp_context=get_context("fork"), initializer=_init_worker,
                             initargs=(os.getpid(), *args)) as pool:
        pending: deque = deque()
        try:
            pool.submit(os.getpid).result()
            for index, records in chunks:
                pending.append(pool.submit(_encode_in_worker, index, records))
                if len(pending) >= 2 * job.workers:
                    on_done(store.write(*pending.popleft().result()))
            while pending:
                on_done(store.write(*pending.popleft().result()))
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def run_tokenize(job: TokenizeJob, log: Callable[[str], None] = print) -> dict:
    """Run (or continue) one tokenize job; returns ``{"manifest": ...}`` for a whole run, the part summary else."""
    job.check()
    out = Path(job.out)
    index, count = job.part
    whole = count == 1
    final = out / job.source
    work = work_dir(out, job.source) if whole else part_dir(out, job.source, index, count)
    if whole and final.exists() and not (work / "done.json").exists():
        raise ShardError(f"{final} already exists; shards are immutable, delete it or choose another --out")
    created_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(work) + ".lock")
    stale_lock = Path(lock.lock_file).exists()  # a killed run's; a refused run leaves it as it found it
    finished = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise WorkDirError(f"another `data tokenize` is writing {work} (lock {lock.lock_file}); wait for it") from None
    created = not work.exists()
    store = ChunkStore(work)
    try:
        store.claim(job.identity())
        summary = store.done() or _encode(job, store, log)
        if not whole:
            log(f"{work}: part {index}/{count} complete, {summary['records']} records read; "
                "join the parts with `ds-trhash data merge-parts`")
            finished = True
            return {"part": summary}
        # final exists: an earlier run published the shards, then stopped before cleaning up
        remove_stale_temporaries(out, job.source)
        manifest = join_stores([store], out, job.max_bad_records, log, shards_written=final.exists())
        store.remove()
        finished = True
        return {"manifest": manifest}
    except BaseException:
        if created and work.exists() and not any(work.glob("c-*.json")):  # nothing worth keeping
            store.remove()
        raise
    finally:
        lock.release()
        if finished or not stale_lock:  # held only while a run writes: leave none behind
            Path(lock.lock_file).unlink(missing_ok=True)
        if created_out and not any(out.iterdir()):
            out.rmdir()


def _encode(job: TokenizeJob, store: ChunkStore, log: Callable[[str], None]) -> dict:
    index, count = job.part
    limit = BadRecordLimit(job.max_bad_records, [s.label for s in job.inputs])
    owned = index
    while (record := store.verified(owned)) is not None:  # the completed prefix, kept as it is
        limit.add(record)
        owned += count
    if owned != index:
        log(f"{store.root}: continuing after {(owned - index) // count} completed chunks")
    resume_from = owned
    seen = [0]
    def wanted(n: int) -> bool:
        return n % count == index and n >= resume_from

    def unwanted(first: int, records: int) -> bool:
        size = job.chunk_records
        return not any(wanted(n) for n in range(first // size, (first + records - 1) // size + 1))

    progress = TokenizeProgress(job.source, job.inputs)  # stderr: a live line on a terminal, else plain lines
    chunks = _chunks(progress.observe(iter_records(job.inputs, job.text_field, unwanted)), job.chunk_records,
                     wanted, seen)
    def done(record: dict) -> None:
        limit.add(record)
        progress.chunk(record)

    try:
        _encode_all(job, chunks, store, done)
    finally:
        progress.close()
    total_chunks = -(-seen[0] // job.chunk_records)
    summary = {"records": seen[0], "chunks": total_chunks}
    store.mark_done(summary)
    return summary
