"""Raw records of every input kind, and what makes a record bad (never silently dropped)."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ds_trhash.data.build.inputs import (
    InputError,
    Record,
    Skipped,
    decode_record,
    file_format,
    file_inputs,
    hf_input,
    iter_records,
)


def decoded(paths, field="text", fmt="auto"):
    """(input index, record number, text or None, reason or None) for every record."""
    return [(r.source, r.number, *decode_record(r, field)) for r in iter_records(file_inputs(paths, fmt), field)]


def test_text_blocks_keep_line_numbers_and_flag_invalid_utf8(tmp_path):
    book = tmp_path / "book.txt"
    book.write_bytes(b"Para one\r\nstill one\r\n\r\n\n  \nPara two\n\nbad \xff byte\nPara three")
    assert decoded([book]) == [
        (0, 1, "Para one\nstill one", None),
        (0, 6, "Para two", None),
        (0, 8, None, "invalid UTF-8 at byte 4"),
    ]


def test_jsonl_and_jsonl_gz_bad_records_are_named(tmp_path):
    lines = [
        json.dumps({"text": "first"}),
        "",
        json.dumps({"text": ""}),
        "{oops",
        json.dumps(["a list"]),
        json.dumps({"body": "no text"}),
        json.dumps({"text": 7}),
        '{"text": "lone \\ud800 surrogate"}',
        json.dumps({"text": None}),
        json.dumps({"text": "last"}),
    ]
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xc3("}\n')
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    got = decoded([plain, packed])
    assert got[: len(got) // 2] == [
        (0, 1, "first", None),
        (0, 3, "", None),
        (0, 4, None, "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (0, 5, None, "a JSON list, not an object"),
        (0, 6, None, "no field 'text'"),
        (0, 7, None, "field 'text' is int, not a string"),
        (0, 8, None, "invalid UTF-8 (unpaired surrogate at character 5)"),
        (0, 9, None, "field 'text' is null, not a string"),
        (0, 10, "last", None),
        (0, 11, None, "invalid UTF-8 at byte 10"),
    ]
    assert [g[1:] for g in got[len(got) // 2:]] == [g[1:] for g in got[: len(got) // 2]]
    assert {g[0] for g in got[len(got) // 2:]} == {1}
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes())[:40])
    with pytest.raises(InputError, match="cut.jsonl.gz is not a complete gzip file"):
        decoded([tmp_path / "cut.jsonl.gz"])


def test_parquet_rows_nulls_binary_and_missing_column(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["one", None, "three"], "n": [1, 2, 3]}), path, row_group_size=2)
    assert decoded([path]) == [(0, 0, "one", None), (0, 1, None, "field 'text' is null, not a string"),
                               (0, 2, "three", None)]
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"body": pa.array([b"ok", b"\xff"], pa.binary())}), raw)
    assert decoded([raw], "body") == [(0, 0, "ok", None), (0, 1, None, "invalid UTF-8 at byte 0")]
    with pytest.raises(InputError, match=r"t.parquet has no column 'body' \(columns: text, n\); set --text-field"):
        decoded([path], "body")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(InputError, match="junk.parquet is not a readable Parquet file"):
        decoded([tmp_path / "junk.parquet"])


def test_formats_by_suffix_and_missing_files(tmp_path):
    assert [file_format(tmp_path / n) for n in ("a.jsonl", "a.JSONL.GZ", "a.json.gz", "a.parquet", "a.txt", "a")] == [
        "jsonl", "jsonl", "jsonl", "parquet", "text", "text"]
    assert file_format(tmp_path / "a.txt", "jsonl") == "jsonl"
    with pytest.raises(InputError, match="missing.txt does not exist"):
        file_inputs([tmp_path / "missing.txt"])


def test_hf_dataset_streams_through_datasets(tmp_path, monkeypatch):
    """A local dataset directory, read by ``datasets.load_dataset(..., streaming=True)`` offline."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    pq.write_table(pa.table({"content": ["alpha", "beta", None]}), repo / "train-00000.parquet")
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    spec = hf_input(str(tmp_path / "repo"), None, "train")
    got = [(r.number, *decode_record(r, "content")) for r in iter_records([spec], "content")]
    assert got == [(0, "alpha", None), (1, "beta", None), (2, None, "field 'content' is null, not a string")]
    assert calls[0][1]["streaming"] is True and calls[0][1]["split"] == "train" and calls[0][1]["revision"] is None
    pinned = hf_input("owner/name", "cfg", "validation", "0123abc")
    assert pinned.label == "hf:owner/name@0123abc[cfg]:validation"
    assert pinned.identity() == {"input": pinned.label, "format": "hf", "name": "owner/name", "config": "cfg",
                                 "split": "validation", "revision": "0123abc"}
    assert [(r.kind, r.raw) for r in iter_records([spec], "text")] == [("missing", None)] * 3
    assert decode_record(next(iter_records([spec], "text")), "text") == (None, "no field 'text'")
    with pytest.raises(InputError, match="cannot be opened"):
        list(iter_records([hf_input(str(tmp_path / "nothing-here"))], "text"))


def test_parquet_rows_nobody_wants_are_counted_not_built(tmp_path):
    (tmp_path / "lead.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(1000)]}), path)
    asked = []

    def unwanted(first, count):
        asked.append((first, count))
        return first >= 256  # only the first slice of 256 rows is wanted

    items = list(iter_records(file_inputs([tmp_path / "lead.jsonl", path]), "text", unwanted))
    records = [i for i in items if isinstance(i, Record)]
    assert [r.raw for r in records[:2]] == [b'{"text": "a"}\n', b'{"text": "b"}\n']
    assert [(r.number, r.raw) for r in records[2:]][-1] == (255, "row 255") and len(records) == 2 + 256
    assert [i.count for i in items if isinstance(i, Skipped)] == [256, 256, 232]
    assert asked[0] == (2, 256) and asked[1] == (258, 256)  # stream positions: the JSONL's two lines first
