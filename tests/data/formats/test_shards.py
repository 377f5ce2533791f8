import hashlib
import json

import numpy as np
import pytest

from ds_trhash.data.formats.shards import (
    ShardError,
    load_manifest,
    load_manifests,
    read_jsonl_texts,
    read_row,
    read_rows,
    read_text_documents,
    tokenize_to_shards,
    write_shards,
)
from ds_trhash.data.formats.tokenizer import load_tokenizer, tokenizer_sha256, train_tokenizer

L, R = 8, 3


def _docs(lengths, start=5):
    """Documents of consecutive ids (so stream positions are recognisable), each ending with EOS 0."""
    docs, value = [], start
    for length in lengths:
        docs.append(np.append(np.arange(value, value + length), 0))
        value += length
    return docs


def test_stream_is_cut_into_overlapping_shards_without_losing_labels(tmp_path):
    docs = _docs([30, 17, 40, 9])
    stream = np.concatenate(docs)  # 100 tokens
    manifest = write_shards("src", docs, L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    # 100 tokens give (100 - 1) // 8 = 12 rows: 4 shards of 3 rows, 97 tokens used, 3 dropped.
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 3, 3]
    assert manifest["total_rows"] == 12 and manifest["dropped_tokens"] == 3
    assert manifest["stream_tokens"] == 100 and manifest["documents"] == 4
    for k, shard in enumerate(manifest["shards"]):
        data = np.fromfile(tmp_path / "src" / shard["file"], dtype="<u2")
        assert len(data) == shard["tokens"] == shard["rows"] * L + 1
        assert np.array_equal(data, stream[k * R * L : k * R * L + R * L + 1])
        assert shard["sha256"] == hashlib.sha256(data.tobytes()).hexdigest()
    first = np.fromfile(tmp_path / "src" / "shard-00000.bin", dtype="<u2")
    second = np.fromfile(tmp_path / "src" / "shard-00001.bin", dtype="<u2")
    assert first[-1] == second[0]
    assert load_manifest(tmp_path / "src") == manifest
    assert json.loads((tmp_path / "src" / "manifest.json").read_text())["seq_len"] == L


def test_trailing_partial_shard_keeps_whole_rows_only(tmp_path):
    docs = _docs([3 * R * L + 2 * L + 4 - 1])  # one shard, then 2 rows + 4 spare tokens (EOS included)
    manifest = write_shards("src", docs, L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 3, 2]
    assert manifest["shards"][-1]["tokens"] == 2 * L + 1
    assert manifest["dropped_tokens"] == 3


def test_read_row_returns_shifted_window(tmp_path):
    docs = _docs([60])
    stream = np.concatenate(docs)
    write_shards("src", docs, L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    inputs, labels = read_row(tmp_path / "src" / "shard-00001.bin", 2, L)
    base = R * L + 2 * L
    assert np.array_equal(inputs, stream[base : base + L])
    assert np.array_equal(labels, stream[base + 1 : base + L + 1])
    assert inputs.dtype == np.int64
    assert read_rows(tmp_path / "src" / "shard-00001.bin", [2, 0], L).shape == (2, L + 1)
    with pytest.raises(ShardError, match="row 3 is outside"):
        read_row(tmp_path / "src" / "shard-00001.bin", 3, L)
    with pytest.raises(ShardError, match="wrong seq_len"):
        read_row(tmp_path / "src" / "shard-00001.bin", 0, 5)


def test_out_of_range_ids_and_bad_settings_are_errors(tmp_path):
    with pytest.raises(ShardError, match="token id 1234"):
        write_shards("src", [np.array([5, 1234, 0])], L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    assert not any(tmp_path.iterdir()), "a failed write leaves nothing behind"
    with pytest.raises(ShardError, match="does not fit uint16"):
        write_shards("src", _docs([50]), L, R, tmp_path, vocab_size=70000, tokenizer_hash="h")
    with pytest.raises(ShardError, match="fewer than one row"):
        write_shards("src", _docs([4]), L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    with pytest.raises(ShardError, match="source name"):
        write_shards("../x", _docs([50]), L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    write_shards("src", _docs([50]), L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")
    with pytest.raises(ShardError, match="already exists"):
        write_shards("src", _docs([50]), L, R, tmp_path, vocab_size=1000, tokenizer_hash="h")


def test_tokenize_to_shards_appends_eos_and_records_tokenizer(tmp_path):
    texts = [f"document number {i} talks about hash routed experts." for i in range(40)]
    tok_dir = tmp_path / "tok"
    train_tokenizer(texts, 300, tok_dir)
    manifest = tokenize_to_shards("web", iter(texts), tok_dir, 16, 4, tmp_path / "shards", vocab_size=300)
    assert manifest["tokenizer_sha256"] == tokenizer_sha256(tok_dir)
    assert manifest["documents"] == 40 and manifest["vocab_size"] == 300
    used = sum(s["rows"] for s in manifest["shards"]) * 16 + 1
    assert used + manifest["dropped_tokens"] == manifest["stream_tokens"]
    stored = np.concatenate(
        [np.fromfile(tmp_path / "shards" / "web" / s["file"], dtype="<u2")[(1 if k else 0):]
         for k, s in enumerate(manifest["shards"])]
    )
    tok = load_tokenizer(tok_dir)
    expected = np.concatenate([tok.encode(t).ids + [0] for t in texts])
    assert np.array_equal(stored, expected[: len(stored)])
    assert len(expected) - len(stored) == manifest["dropped_tokens"]
    with pytest.raises(ShardError, match="token id"):
        tokenize_to_shards("small", iter(texts), tok_dir, 16, 4, tmp_path / "shards", vocab_size=200)


def test_jsonl_and_text_readers(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "first"}\n\n{"text": ""}\n{"body": "x", "text": "second"}\n', encoding="utf-8")
    assert list(read_jsonl_texts([jsonl])) == ["first", "second"]
    other = tmp_path / "b.jsonl"
    other.write_text('{"body": "only body"}\n', encoding="utf-8")
    assert list(read_jsonl_texts([other], text_field="body")) == ["only body"]
    with pytest.raises(ShardError, match=r"b.jsonl:1 has no string field 'text'"):
        list(read_jsonl_texts([other]))
    broken = tmp_path / "c.jsonl"
    broken.write_text('{"text": "ok"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ShardError, match=r"c.jsonl:2 is not valid JSON"):
        list(read_jsonl_texts([broken]))
    text = tmp_path / "book.txt"
    text.write_text("Para one\nstill one\n\n\n  \nPara two\n\nPara three", encoding="utf-8")
    assert list(read_text_documents([text])) == ["Para one\nstill one", "Para two", "Para three"]


def test_load_manifests_accepts_files_source_dirs_and_roots(tmp_path):
    write_shards("a", _docs([40]), L, R, tmp_path / "root", vocab_size=1000, tokenizer_hash="h")
    write_shards("b", _docs([40]), L, R, tmp_path / "root", vocab_size=1000, tokenizer_hash="h")
    assert set(load_manifests([tmp_path / "root"])) == {"a", "b"}
    assert set(load_manifests([tmp_path / "root" / "a", tmp_path / "root" / "b" / "manifest.json"])) == {"a", "b"}
    with pytest.raises(ShardError, match="given twice"):
        load_manifests([tmp_path / "root", tmp_path / "root" / "a"])
    with pytest.raises(ShardError, match="does not exist"):
        load_manifests([tmp_path / "missing"])
