"""Building the tokenized SFT set: layout, manifest, validation and the no-truncation gate."""
import json

import numpy as np
import pytest
from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.data.sft.chat import EOS_ID, IGNORE_INDEX, tokenize_example
from ds_trhash.io import sha256_file
from ds_trhash.data.sft.build import (
    MAX_LISTED_ERRORS,
    PARTITION_FILES,
    SFTBuildError,
    build_sft_dataset,
)


@pytest.fixture()
def sources(tmp_path):
    train = [{"messages": conversation(i, turns=1 + i % 3), "capability": "math" if i % 2 else None} for i in range(12)]
    train[0]["source"] = "handwritten"
    evaluation = [{"messages": conversation(100 + i)} for i in range(3)]
    return write_jsonl(tmp_path / "train.jsonl", train), write_jsonl(tmp_path / "eval.jsonl", evaluation)


def test_build_writes_partitions_that_round_trip(sources, tokenizer_dir, tokenizer, tmp_path):
    train, evaluation = sources
    out = tmp_path / "sft"
    manifest = build_sft_dataset(train, evaluation, tokenizer_dir, 512, out, source_name="demo", revision="r1")
    assert json.loads((out / "manifest.json").read_text()) == manifest
    records = [json.loads(line) for line in train.read_text().splitlines()]
    ids = np.fromfile(out / "train" / "input_ids.bin", dtype="<u4")
    labels = np.fromfile(out / "train" / "labels.bin", dtype="<i4")
    index = [json.loads(line) for line in (out / "train" / "examples.jsonl").read_text().splitlines()]
    assert len(index) == 12
    for record, entry in zip(records, index):
        expected = tokenize_example(record["messages"], tokenizer)
        span = slice(entry["offset"], entry["offset"] + entry["num_tokens"])
        assert ids[span].tolist() == expected.input_ids
        assert labels[span].tolist() == expected.labels
        assert entry["supervised_tokens"] == expected.supervised_tokens
    assert [e["capability"] for e in index[:3]] == ["general", "math", "general"]
    assert [e["source"] for e in index[:2]] == ["handwritten", "demo"]
    idx = json.loads((out / "train" / "sft.idx.json").read_text())
    assert (idx["examples"], idx["num_tokens"], idx["eos_token_id"], idx["vocab_size"]) == (12, len(ids), EOS_ID, VOCAB_SIZE)
    assert idx["supervised_tokens"] == int((labels != IGNORE_INDEX).sum())
    assert idx["chat_template"] == "complexity-chat-v2"


def test_manifest_records_hashes_counts_and_identity(sources, tokenizer_dir, tmp_path):
    out = tmp_path / "sft"
    manifest = build_sft_dataset(*sources, tokenizer_dir, 512, out, revision="abc123")
    for part in ("train", "eval"):
        for name in PARTITION_FILES:
            assert manifest["partitions"][part]["files"][name] == sha256_file(out / part / name)
    assert manifest["tokenizer"]["sha256"] == sha256_file(tokenizer_dir / "tokenizer.json")
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert json.loads((out / "chat_template.json").read_text())["id"] == "complexity-chat-v2"
    assert manifest["files"]["chat_template.json"] == sha256_file(out / "chat_template.json")
    assert "manifest.json" not in manifest["files"]
    assert manifest["eos"] == {"token": "</s>", "id": 0}
    assert (manifest["vocab_size"], manifest["seq_len"], manifest["supervision"]) == (VOCAB_SIZE, 512, "final_assistant_only")
    assert [s["name"] for s in manifest["sources"]] == ["train", "eval"]
    assert {s["revision"] for s in manifest["sources"]} == {"abc123"}
    assert manifest["partitions"]["eval"]["examples"] == 3
    assert manifest["dropped"]["total"] == 0
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


BAD_RECORDS = {
    "too_long": {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"}]},
    "not_ending_with_assistant": {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]},
    "empty_final_assistant": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n "}]},
    "unknown_role": {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "ok"}]},
    "invalid_json": '{"messages": [',
    "missing_messages": {"conversation": []},
}
REASON_TEXT = {
    "too_long": "exceed the sequence cap 256",
    "not_ending_with_assistant": "ends with a user turn",
    "empty_final_assistant": "final assistant message is empty",
    "unknown_role": "unknown role 'robot'",
    "invalid_json": "not valid JSON",
    "missing_messages": 'with a "messages" list',
}


def _with_bad(tmp_path, bad):
    good = [{"messages": conversation(i)} for i in range(4)]
    return write_jsonl(tmp_path / "train.jsonl", good[:2] + bad + good[2:])


@pytest.mark.parametrize("code", sorted(BAD_RECORDS))
def test_each_invalid_example_fails_the_build_naming_file_and_line(code, tokenizer_dir, tmp_path):
    train = _with_bad(tmp_path, [BAD_RECORDS[code]])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"messages": conversation(9)}])
    out = tmp_path / "sft"
    with pytest.raises(SFTBuildError) as err:
        build_sft_dataset(train, evaluation, tokenizer_dir, 256, out)
    assert "train.jsonl:3: " in str(err.value) and REASON_TEXT[code] in str(err.value)
    assert str(err.value).startswith("1 invalid SFT example(s):") and "--drop-invalid" in str(err.value)
    assert not out.exists()
    assert list(tmp_path.iterdir()) and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_no_truncation_gate_is_exact_at_the_cap(tokenizer_dir, tokenizer, tmp_path):
    record = {"messages": conversation(3)}
    length = len(tokenize_example(record["messages"], tokenizer).input_ids)
    train = write_jsonl(tmp_path / "train.jsonl", [record])
    build_sft_dataset(train, train, tokenizer_dir, length, tmp_path / "fits")
    with pytest.raises(SFTBuildError, match=f"{length} tokens exceed the sequence cap {length - 1}"):
        build_sft_dataset(train, train, tokenizer_dir, length - 1, tmp_path / "too_long")


def test_drop_invalid_skips_and_counts_by_reason(tokenizer_dir, tmp_path):
    bad = [BAD_RECORDS[c] for c in sorted(BAD_RECORDS)] + [BAD_RECORDS["too_long"]]
    train = _with_bad(tmp_path, bad)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"messages": conversation(9)}, BAD_RECORDS["unknown_role"]])
    manifest = build_sft_dataset(train, evaluation, tokenizer_dir, 256, tmp_path / "sft", drop_invalid=True)
    assert manifest["partitions"]["train"]["examples"] == 4
    assert manifest["partitions"]["train"]["dropped"]["too_long"] == 2
    assert manifest["partitions"]["eval"]["dropped"] == {"unknown_role": 1}
    assert manifest["dropped"]["by_reason"] == {
        "empty_final_assistant": 1, "invalid_json": 1, "missing_messages": 1,
        "not_ending_with_assistant": 1, "too_long": 2, "unknown_role": 2,
    }
    assert manifest["dropped"]["total"] == 8


def test_error_listing_is_capped(tokenizer_dir, tmp_path):
    train = _with_bad(tmp_path, [BAD_RECORDS["invalid_json"]] * (MAX_LISTED_ERRORS + 5))
    with pytest.raises(SFTBuildError) as err:
        build_sft_dataset(train, train, tokenizer_dir, 256, tmp_path / "sft")
    message = str(err.value)
    assert message.startswith(f"{2 * (MAX_LISTED_ERRORS + 5)} invalid SFT example(s):")
    assert message.count("not valid JSON") == MAX_LISTED_ERRORS
    assert f"... and {MAX_LISTED_ERRORS + 10} more" in message


def test_existing_output_is_refused_unless_empty(sources, tokenizer_dir, tmp_path):
    out = tmp_path / "sft"
    out.mkdir()
    build_sft_dataset(*sources, tokenizer_dir, 512, out)  # empty directory: allowed
    before = sha256_file(out / "manifest.json")
    with pytest.raises(SFTBuildError, match="already exists"):
        build_sft_dataset(*sources, tokenizer_dir, 512, out)
    assert sha256_file(out / "manifest.json") == before


def test_vocabulary_smaller_than_the_tokenizer_is_refused(sources, tokenizer_dir, tmp_path):
    with pytest.raises(SFTBuildError, match=f"tokenizer has {VOCAB_SIZE} entries but the vocabulary size is 100"):
        build_sft_dataset(*sources, tokenizer_dir, 512, tmp_path / "sft", vocab_size=100)
    manifest = build_sft_dataset(*sources, tokenizer_dir, 512, tmp_path / "big", vocab_size=32000)
    assert manifest["vocab_size"] == 32000 and manifest["tokenizer"]["vocab_size"] == VOCAB_SIZE


def test_partition_left_empty_fails(tokenizer_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": conversation(1)}])
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [BAD_RECORDS["unknown_role"]])
    with pytest.raises(SFTBuildError, match="no valid example left in partition\\(s\\) eval"):
        build_sft_dataset(train, evaluation, tokenizer_dir, 256, tmp_path / "sft", drop_invalid=True)
    assert not (tmp_path / "sft").exists()


def test_missing_tokenizer_is_a_build_error(sources, tmp_path):
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(SFTBuildError, match="cannot use the tokenizer at .*no_tokenizer.*has no tokenizer.json"):
        build_sft_dataset(*sources, tmp_path / "no_tokenizer", 512, tmp_path / "sft")
    assert not (tmp_path / "sft").exists()
