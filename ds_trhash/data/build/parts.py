"""Parts of a tokenize run, and how chunks become one source.

``--part i/K`` (parts count from 0) owns the chunks ``n`` with ``n % K == i``: every part reads the
whole input (cheaply, without decoding or tokenizing what it does not own; Parquet rows of other
parts are counted without building their strings) and tokenizes one chunk in K, so
parts take about the same time whatever the input's layout. A part stops at its work directory
``<out>/<source>.part-<i>-of-<K>``: its token stream is not cut into shards on its own, because
shard ``k`` of a source is fixed by stream positions (docs/contracts.md §2: ``rows·L + 1`` tokens,
consecutive shards sharing one token), and a part's stream starts mid-source.

``data merge-parts`` checks that the K directories are the K parts of one run (same inputs,
tokenizer, settings; each index once; each complete; every chunk whole) and feeds their chunks, in
chunk order, to the same shard writer a single-machine run uses; so its shards, manifest and
report are byte-identical to that run's. A single-machine run is the one-part case of the same join.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from filelock import FileLock, Timeout

from ds_trhash.io import read_json_object, write_json_atomic

from ds_trhash.data.build.chunk_store import ChunkStore, WorkDirError, differences
from ds_trhash.data.formats.shards import MANIFEST_FILE, ShardError, write_shards

REPORT_FILE = "tokenize_report.json"


class BadRecordsError(ShardError):
    """More bad input records than ``--max-bad-records`` allows."""


def work_dir(out: Path, source: str) -> Path:
    return Path(out) / f".{source}.tokenize"


def part_dir(out: Path, source: str, index: int, count: int) -> Path:
    return Path(out) / f"{source}.part-{index}-of-{count}"


def parse_part(text: str) -> tuple[int, int]:
    """``"i/K"`` -> ``(i, K)`` with ``0 <= i < K``."""
    index, sep, count = text.partition("/")
    try:
        part = (int(index), int(count))
    except ValueError:
        part = None
    if not sep or part is None or not 0 <= part[0] < part[1]:
        raise ShardError(f"--part {text!r} must be I/K with 0 <= I < K (parts count from 0), e.g. 0/4")
    return part


def remove_stale_temporaries(out: Path, source: str) -> None:
    """Delete the shard writer's temporary directories left by killed runs (their process is gone)."""
    for tmp in Path(out).glob(f".{source}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # someone else's live process
            pass


class BadRecordLimit:
    """Counts bad records chunk by chunk and fails once there are more than ``limit``."""

    def __init__(self, limit: int, labels: Sequence[str]) -> None:
        self.limit = limit
        self.labels = list(labels)
        self.bad: list[dict] = []
        self.inputs: list[dict[str, Any]] = [{"input": label, "records": 0, "documents": 0, "empty": 0, "bad": 0} for label in labels]

    def add(self, record: dict) -> None:
        for key, tally in record["inputs"].items():
            for name, value in tally.items():
                self.inputs[int(key)][name] += value
        for bad in record["bad"]:
            self.bad.append(bad)
            if len(self.bad) > self.limit:
                raise BadRecordsError(
                    f"{bad['at']}: {bad['reason']}; that is bad record {len(self.bad)}, more than "
                    f"--max-bad-records {self.limit}. Fix the input (then delete the work directory), or raise "
                    "--max-bad-records and run the same command again: completed chunks are kept")

    def report(self, source: str) -> dict:
        totals = {name: sum(tally[name] for tally in self.inputs) for name in ("records", "documents", "empty", "bad")}
        return {"source": source, **totals, "inputs": self.inputs,
                "bad_records": [{"at": bad["at"], "reason": bad["reason"]} for bad in self.bad]}


def _shared(identity: dict) -> dict:
    """What every part of one run shares: its identity less the part index and the inputs'
    modification times (parts on other machines may read copies of the inputs, equal in name and
    size; the records each part read are compared too, below)."""
    inputs = [{k: v for k, v in spec.items() if k != "mtime_ns"} for spec in identity.get("inputs", [])]
    return {**{k: v for k, v in identity.items() if k != "part"}, "inputs": inputs}


def _by_part(stores: Sequence[ChunkStore]) -> tuple[dict, dict[int, ChunkStore]]:
    """Check that ``stores`` are the complete parts of one run; return its identity and the parts by index."""
    identities = [store.identity() for store in stores]
    count = identities[0]["part"][1]
    first = _shared(identities[0])
    parts: dict[int, ChunkStore] = {}
    for store, identity in zip(stores, identities):
        index, k = identity["part"]
        if k != count:
            raise WorkDirError(f"{store.root} is part {index}/{k}, but {stores[0].root} is one of {count} parts")
        if index in parts:
            raise WorkDirError(f"part {index}/{count} is given twice ({parts[index].root} and {store.root})")
        diff = differences(first, _shared(identity), f"in {stores[0].root}", f"in {store.root}")
        if diff:
            raise WorkDirError(f"{store.root} is not a part of the same run as {stores[0].root}: {'; '.join(diff)}")
        parts[index] = store
    missing = [f"{i}/{count}" for i in range(count) if i not in parts]
    if missing:
        raise WorkDirError(f"parts {', '.join(missing)} are missing; pass all {count} part directories")
    summaries = {}
    for index, store in sorted(parts.items()):
        summary = store.done()
        if summary is None:
            raise WorkDirError(f"{store.root} (part {index}/{count}) is not complete; run its `data tokenize --part` "
                               "command again to finish it")
        summaries[index] = summary
    if len({(s["records"], s["chunks"]) for s in summaries.values()}) > 1:
        seen = ", ".join(f"part {i}: {s['records']} records" for i, s in sorted(summaries.items()))
        raise WorkDirError(f"the parts read different inputs ({seen}); the input changed between them, rerun them all")
    return {**first, "chunks": summaries[0]["chunks"], "part_count": count}, parts


def _tally(run: dict, parts: dict[int, ChunkStore], max_bad_records: int) -> BadRecordLimit:
    """Every chunk's record, in chunk order, through the bad-record limit."""
    count = run["part_count"]
    limit = BadRecordLimit(max_bad_records, [spec["input"] for spec in run["inputs"]])
    for n in range(run["chunks"]):
        record = parts[n % count].record(n)
        if record is None:
            raise WorkDirError(f"{parts[n % count].root} lacks chunk {n}; delete its done.json and run that part again")
        limit.add(record)
    return limit


def join_stores(stores: Sequence[ChunkStore], out: Path, max_bad_records: int,
                log: Callable[[str], None] = print, *, shards_written: bool = False) -> dict:
    """Cut the chunks of ``stores`` (the parts of one run) into the source's shards under ``out``,
    then write its report. ``shards_written``: an earlier run published the shards and stopped
    before the report; only the report is (re)written."""
    run, parts = _by_part(stores)
    limit = _tally(run, parts, max_bad_records)
    final = Path(out) / run["source"]

    def documents() -> Iterator[np.ndarray]:
        for n in range(run["chunks"]):
            yield from parts[n % run["part_count"]].documents(n)

    if shards_written:  # the JSON as written (not a loader's view of it), for the same summary line
        manifest = read_json_object(final / MANIFEST_FILE, ShardError)
    else:
        manifest = write_shards(run["source"], documents(), run["seq_len"], run["rows_per_shard"], out,
                                run["vocab_size"], run["tokenizer_sha256"])
    report = limit.report(run["source"])
    write_json_atomic(final / REPORT_FILE, report, fsync=False)
    log(f"{final / 'manifest.json'}: {manifest['documents']} documents, {len(manifest['shards'])} shards, "
        f"{manifest['total_rows']} rows, {manifest['dropped_tokens']} tokens dropped")
    for tally in report["inputs"]:
        log(f"  {tally['input']}: {tally['records']} records, {tally['documents']} documents, "
            f"{tally['empty']} empty, {tally['bad']} bad")
    for bad in report["bad_records"][:20]:
        log(f"  bad record {bad['at']}: {bad['reason']}")
    if len(report["bad_records"]) > 20:
        log(f"  ... {len(report['bad_records']) - 20} more bad records in {final / REPORT_FILE}")
    return manifest


def merge_parts(dirs: Sequence[Path], out: Path, max_bad_records: int = 0,
                log: Callable[[str], None] = print) -> dict:
    """`data merge-parts`: join K part directories into ``<out>/<source>``; the parts are left as they are."""
    stores = [ChunkStore(Path(d)) for d in dirs]
    run, _ = _by_part(stores)  # refuse what is not one whole run before anything is written
    out = Path(out)
    final = out / run["source"]
    if final.exists():
        raise ShardError(f"{final} already exists; shards are immutable, delete it or choose another --out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out / f".{run['source']}.merge.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise WorkDirError(f"another `data merge-parts` is writing {final}; wait for it") from None
    try:
        remove_stale_temporaries(out, run["source"])
        return join_stores(stores, out, max_bad_records, log)
    finally:
        lock.release()
        Path(lock.lock_file).unlink(missing_ok=True)
        if created and not any(out.iterdir()):  # a refused merge leaves no trace
            out.rmdir()
