"""`data tokenize` with N workers: byte-identical output, bad records, refusals over a partial run."""
import json

import numpy as np
from filelock import FileLock

from ds_trhash.data.build.chunk_store import ChunkStore

from tests.data.tokenize_fixtures import (  # noqa: F401 (corpus_tok is a fixture)
    corpus_tok,
    expected_stream,
    stored_stream,
    text,
    tokenize,
    write_inputs,
)
from tests.fail_closed import tree_digest


def test_any_worker_count_writes_the_same_bytes_in_input_order(tmp_path, capsys, corpus_tok):
    inputs = write_inputs(tmp_path / "in")
    code, out, err = tokenize(capsys, inputs, tmp_path / "one", corpus_tok, "--workers", "1")
    assert code == 0, err
    assert "240 documents" in out and "d.parquet: 60 records, 60 documents, 0 empty, 0 bad" in out
    assert tokenize(capsys, inputs, tmp_path / "two", corpus_tok, "--workers", "2")[0] == 0
    one, two = tree_digest(tmp_path / "one"), tree_digest(tmp_path / "two")
    assert one == two and sorted(one)[:2] == ["web", "web/manifest.json"]  # no work directory or lock left
    assert set(one) == {"web", *(f"web/{s['file']}" for s in json.loads(
        (tmp_path / "one" / "web" / "manifest.json").read_text())["shards"]), "web/manifest.json",
        "web/tokenize_report.json"}
    stream = stored_stream(tmp_path / "one" / "web")
    expected = expected_stream(corpus_tok, [text(i) for i in range(240)])
    manifest = json.loads((tmp_path / "one" / "web" / "manifest.json").read_text())
    assert np.array_equal(stream, expected[: len(stream)])
    assert len(expected) - len(stream) == manifest["dropped_tokens"] and manifest["documents"] == 240
    report = json.loads((tmp_path / "one" / "web" / "tokenize_report.json").read_text())
    assert [(t["input"].rsplit("/", 1)[-1], t["records"], t["bad"]) for t in report["inputs"]] == [
        ("a.txt", 60, 0), ("b.jsonl", 60, 0), ("c.jsonl.gz", 60, 0), ("d.parquet", 60, 0)]


def _with_bad_records(root):
    root.mkdir(parents=True)
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps({"text": text(i)}) + "\n" for i in range(40)))
    bad = root / "bad.jsonl"
    lines = [json.dumps({"text": text(i)}) for i in range(40, 80)]
    lines[2] = json.dumps({"body": "no text field"})
    lines[30] = '{"text": "cut'
    bad.write_text("\n".join(lines) + "\n")
    return [good, bad]


def test_bad_records_fail_past_the_limit_and_a_raised_limit_continues(tmp_path, capsys, corpus_tok):
    inputs = _with_bad_records(tmp_path / "in")
    out = tmp_path / "shards"
    assert tokenize(capsys, [tmp_path / "in" / "good.jsonl"], out, corpus_tok, source="other")[0] == 0
    before = tree_digest(out / "other")
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--workers", "2")
    assert code == 2 and "bad.jsonl line 3: no field 'text'" in err and "--max-bad-records 0" in err
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--max-bad-records", "1")
    assert code == 2 and "bad.jsonl line 31: not valid JSON" in err and "bad record 2" in err
    assert not (out / "web").exists() and tree_digest(out / "other") == before
    kept = {p.name: p.stat().st_mtime_ns for p in (out / ".web.tokenize").glob("c-*.bin")}
    code, stdout, err = tokenize(capsys, inputs, out, corpus_tok, "--max-bad-records", "2", "--workers", "2")
    assert code == 0, err
    assert "continuing after 5 completed chunks" in stdout  # the chunk holding the last straw was stored too
    assert "bad.jsonl: 40 records, 38 documents, 0 empty, 2 bad" in stdout
    assert len(kept) == 5 and not (out / ".web.tokenize").exists()
    report = json.loads((out / "web" / "tokenize_report.json").read_text())
    assert report["bad"] == 2 and [b["at"].rsplit("/", 1)[-1] for b in report["bad_records"]] == [
        "bad.jsonl line 3", "bad.jsonl line 31"]
    good = [text(i) for i in range(80) if i not in (42, 70)]
    stream = stored_stream(out / "web")
    assert np.array_equal(stream, expected_stream(corpus_tok, good)[: len(stream)])
    assert tree_digest(out / "other") == before


def test_other_arguments_over_a_partial_run_are_refused_and_change_nothing(tmp_path, capsys, corpus_tok):
    inputs = _with_bad_records(tmp_path / "in")
    out = tmp_path / "shards"
    assert tokenize(capsys, inputs, out, corpus_tok)[0] == 2  # leaves a partial run
    before = tree_digest(tmp_path)
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--seq-len", "32", "--max-bad-records", "9")
    assert code == 2 and "seq_len: 16 (partial run) vs 32 (this command)" in err and "delete" in err
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--text-field", "body")
    assert code == 2 and "text_field: 'text' (partial run) vs 'body' (this command)" in err
    assert tree_digest(tmp_path) == before
    inputs[1].write_text(inputs[1].read_text() + json.dumps({"text": "one more"}) + "\n")
    before = tree_digest(tmp_path)
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--max-bad-records", "9")
    assert code == 2 and "input 1: {'input': " in err and "bad.jsonl" in err and "'size': " in err
    assert tree_digest(tmp_path) == before


def test_an_existing_source_and_ids_outside_the_vocabulary_are_refused(tmp_path, capsys, corpus_tok):
    inputs = write_inputs(tmp_path / "in", 40)
    out = tmp_path / "shards"
    assert tokenize(capsys, inputs, out, corpus_tok)[0] == 0
    before = tree_digest(tmp_path)
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--workers", "2")
    assert code == 2 and "web already exists; shards are immutable" in err
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--vocab-size", "300", source="small")
    assert code == 2 and "a.txt line 3 encodes to token id" in err and "outside [0, 300)" in err
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--vocab-size", "70000", source="huge")
    assert code == 2 and "does not fit uint16" in err
    code, _, err = tokenize(capsys, inputs, out, corpus_tok, "--part", "2/2", source="p")
    assert code == 2 and "--part '2/2' must be I/K with 0 <= I < K" in err
    assert tree_digest(tmp_path) == before  # a run failing before its first chunk leaves nothing


def test_a_run_stopped_after_publishing_its_shards_finishes_on_the_next_start(tmp_path, capsys, corpus_tok,
                                                                               monkeypatch):
    inputs = write_inputs(tmp_path / "in", 40)
    assert tokenize(capsys, inputs, tmp_path / "reference", corpus_tok)[0] == 0
    out = tmp_path / "shards"
    with monkeypatch.context() as patch:  # the process dies between publishing the shards and cleaning up
        patch.setattr(ChunkStore, "remove", lambda self: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            tokenize(capsys, inputs, out, corpus_tok)
        except KeyboardInterrupt:
            pass
    assert (out / ".web.tokenize" / "done.json").exists() and (out / "web" / "manifest.json").exists()
    (out / "web" / "tokenize_report.json").unlink()  # ... or even before the report was written
    code, stdout, err = tokenize(capsys, inputs, out, corpus_tok)
    assert code == 0, err
    assert "40 documents" in stdout
    assert tree_digest(out) == tree_digest(tmp_path / "reference")


def test_a_second_run_on_the_same_work_directory_is_refused(tmp_path, capsys, corpus_tok):
    inputs = write_inputs(tmp_path / "in", 40)
    out = tmp_path / "shards"
    out.mkdir()
    with FileLock(str(out / ".web.tokenize.lock")):
        before = tree_digest(tmp_path)
        code, _, err = tokenize(capsys, inputs, out, corpus_tok)
        assert code == 2 and "another `data tokenize` is writing" in err
        assert tree_digest(tmp_path) == before
