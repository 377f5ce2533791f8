"""Where `data tokenize` reads documents: local text, JSONL, JSONL.gz, Parquet, or a Hugging Face dataset.

Reading is split in two so that the expensive half runs in the tokenizing workers:

* the parent enumerates *raw records* in input order (``Record``: input index, record number, kind,
  raw payload), cheaply: a text block or a JSONL line stays bytes, a Parquet or dataset value is
  taken as it comes;
* ``decode_record`` (run in a worker) turns one raw record into its text, or into the reason it is
  bad: invalid UTF-8, not JSON, not an object, a missing field, a value that is not a string. Bad
  records are counted and listed by the caller, never dropped silently nor tokenized as garbage.

Record numbers name a record for a human: the line number (from 1) for text and JSONL files (a
text document is the blank-line-separated block starting at that line), the row index (from 0)
for Parquet files and datasets. Empty texts are not documents (they are counted as ``empty``).
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, cast

from ds_trhash.data.formats.shards import ShardError

TEXT, JSONL, VALUE, MISSING = "text", "jsonl", "value", "missing"  # record kinds (MISSING: lacks the field)
FORMATS = ("auto", "text", "jsonl", "parquet")
_ABSENT = object()
_PARQUET_BATCH = 4096
_PARQUET_SLICE = 256  # rows skipped or materialized together


class InputError(ShardError):
    """An input cannot be read at all (not a bad record: the whole file or dataset)."""


@dataclass(frozen=True)
class InputSpec:
    """One input: a local file (``path`` and its ``fmt``) or a dataset (``hf`` = name, config, split)."""

    label: str
    fmt: str
    path: Optional[Path] = None
    hf: Optional[tuple[str, Optional[str], str, Optional[str]]] = None  # name, config, split, revision

    def file(self) -> Path:
        """The local file of an input that is not a dataset (every such spec has one)."""
        if self.path is None:
            raise InputError(f"{self.label}: names neither a file nor a dataset")
        return self.path

    def identity(self) -> dict:
        """What a resumed run must find unchanged: a file's size and mtime, a dataset's coordinates."""
        if self.hf is not None:
            name, config, split, revision = self.hf
            return {"input": self.label, "format": "hf", "name": name, "config": config, "split": split,
                    "revision": revision}
        stat = self.file().stat()
        return {"input": self.label, "format": self.fmt, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_format(path: Path, fmt: str = "auto") -> str:
    """``auto``: JSONL for ``*.jsonl`` / ``*.jsonl.gz`` / ``*.json.gz``, Parquet for ``*.parquet``, else text."""
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json.gz")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def file_inputs(paths: Sequence[os.PathLike | str], fmt: str = "auto") -> list[InputSpec]:
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    specs = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise InputError(f"input {path} does not exist or is not a file; check --input")
        specs.append(InputSpec(str(raw), file_format(path, fmt), path=path))
    return specs


def hf_input(name: str, config: Optional[str] = None, split: str = "train", revision: Optional[str] = None) -> InputSpec:
    """A dataset by name (Hub repository or local directory); ``revision`` pins a Hub dataset's
    commit, so a resumed run or a later part reads what the first one read."""
    label = f"hf:{name}" + (f"@{revision}" if revision else "") + (f"[{config}]" if config else "") + f":{split}"
    return InputSpec(label, "hf", hf=(name, config, split, revision))


@dataclass(frozen=True)
class Record:
    source: int  # index into the run's input list
    number: int  # line (from 1) or row (from 0), see the module docstring
    kind: str  # TEXT / JSONL: raw is bytes; VALUE: raw is the field's value; MISSING: no such field
    raw: object


@dataclass(frozen=True)
class Skipped:
    """``count`` consecutive records the caller does not want: counted, never materialized."""

    count: int


def iter_records(specs: Sequence[InputSpec], text_field: str,
                 unwanted: Optional[Callable[[int, int], bool]] = None) -> Iterator[Record | Skipped]:
    """Every raw record of every input, in input order.

    ``unwanted(first, count)`` is True when the caller wants none of the records at stream
    positions ``[first, first + count)`` (a part skipping other parts' chunks); a Parquet reader
    then yields one ``Skipped`` for such a run of rows instead of building their Python strings.
    """
    position = [0]  # stream position of the next record, advanced as items are handed out
    for index, spec in enumerate(specs):
        reader: Iterator[Record | Skipped]
        if spec.hf is not None:
            reader = _dataset_values(index, spec.hf, text_field)
        elif spec.fmt == "text":
            reader = _text_blocks(index, spec.file())
        elif spec.fmt == "jsonl":
            reader = _jsonl_lines(index, spec.file())
        else:
            reader = _parquet_values(index, spec.file(), text_field, position, unwanted)
        for item in reader:
            position[0] += item.count if isinstance(item, Skipped) else 1
            yield item


def _text_blocks(index: int, path: Path) -> Iterator[Record]:
    block: list[bytes] = []
    start = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                if not block:
                    start = number
                block.append(line.rstrip(b"\r\n"))
            elif block:
                yield Record(index, start, TEXT, b"\n".join(block))
                block = []
    if block:
        yield Record(index, start, TEXT, b"\n".join(block))


def _jsonl_lines(index: int, path: Path) -> Iterator[Record]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield Record(index, number, JSONL, line)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise InputError(f"{path} is not a complete gzip file ({exc}); re-create it or drop the .gz suffix") from None


def _parquet_values(index: int, path: Path, field: str, position: list,
                    unwanted: Optional[Callable[[int, int], bool]]) -> Iterator[Record | Skipped]:
    import pyarrow.parquet as pq  # optional heavy dependency, only for Parquet inputs

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses for a damaged file
        raise InputError(f"{path} is not a readable Parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    if field not in names:
        raise InputError(f"{path} has no column {field!r} (columns: {', '.join(names)}); set --text-field")
    row = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH, columns=[field]):
        column = batch.column(0)
        for start in range(0, len(column), _PARQUET_SLICE):
            piece = column.slice(start, _PARQUET_SLICE)  # zero-copy
            if unwanted is not None and unwanted(position[0], len(piece)):
                row += len(piece)
                yield Skipped(len(piece))
                continue
            for value in piece.to_pylist():
                yield Record(index, row, VALUE, value)
                row += 1


def _dataset_values(index: int, hf: tuple[str, Optional[str], str, Optional[str]], field: str) -> Iterator[Record]:
    import datasets  # optional heavy dependency (~0.5 s to import), only for --hf-dataset

    name, config, split, revision = hf
    try:
        stream = datasets.load_dataset(name, config, split=split, streaming=True, revision=revision)
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise InputError(f"--hf-dataset {name!r} (config {config!r}, split {split!r}) cannot be opened: "
                         f"{' '.join(str(exc).split())}") from None
    if stream.column_names and field in stream.column_names:
        stream = stream.select_columns([field])  # decode only the text column
    for row, example in enumerate(stream):
        value = example.get(field, _ABSENT)
        yield Record(index, row, MISSING, None) if value is _ABSENT else Record(index, row, VALUE, value)


def decode_record(record: Record, text_field: str) -> tuple[Optional[str], Optional[str]]:
    """``(text, None)`` for a good record, ``(None, reason)`` for a bad one."""
    raw = record.raw
    if record.kind == TEXT:
        return _utf8(cast(bytes, raw))  # the kind says what raw holds
    if record.kind == JSONL:
        text, bad = _utf8(cast(bytes, raw))
        if text is None:
            return None, bad
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"not valid JSON ({exc})"
        if not isinstance(doc, dict):
            return None, f"a JSON {type(doc).__name__}, not an object"
        if text_field not in doc:
            return None, f"no field {text_field!r}"
        raw = doc[text_field]
    elif record.kind == MISSING:
        return None, f"no field {text_field!r}"
    if isinstance(raw, bytes):
        return _utf8(raw)
    if not isinstance(raw, str):
        kind = "null" if raw is None else type(raw).__name__
        return None, f"field {text_field!r} is {kind}, not a string"
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON \ud800 escape
        return None, f"invalid UTF-8 (unpaired surrogate at character {exc.start})"
    return raw, None


def _utf8(raw: bytes) -> tuple[Optional[str], Optional[str]]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start}"
