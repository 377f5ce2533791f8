import json
from pathlib import Path

import pytest

from ds_trhash.cli import main
from ds_trhash.data.plans.plan import load_plan, validate_refinement
from ds_trhash.data.formats.shards import load_manifest
from ds_trhash.data.formats.tokenizer import tokenizer_sha256


def cli(argv, capsys):
    code = main(argv)  # the real command line: its one handler prints a refusal and returns 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def inputs(tmp_path):
    prose = tmp_path / "prose.txt"
    prose.write_text("\n\n".join(f"Paragraph {i} explains how experts are routed by hash." for i in range(60)))
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"body": f"note {i}: replay plans never repeat data silently"}) + "\n"
                             for i in range(60)))
    return tmp_path, prose, notes


def test_tokenizer_shards_plan_refinement_fingerprint_end_to_end(inputs, capsys):
    tmp, prose, notes = inputs
    tok = tmp / "tok"
    assert cli(["data", "train-tokenizer", "--input", str(prose), str(notes), "--text-field", "body",
                "--vocab-size", "300", "--out", str(tok)], capsys)[0] == 0
    common = ["--tokenizer", str(tok), "--seq-len", "16", "--rows-per-shard", "4", "--vocab-size", "300",
              "--out", str(tmp / "shards")]
    code, out, _ = cli(["data", "tokenize", "--input", str(prose), "--source", "prose", *common], capsys)
    assert code == 0 and "60 documents" in out
    code, _, _ = cli(["data", "tokenize", "--input", str(notes), "--source", "notes", "--text-field", "body",
                      *common], capsys)
    assert code == 0
    manifest = load_manifest(tmp / "shards" / "notes")
    assert manifest["documents"] == 60 and manifest["tokenizer_sha256"] == tokenizer_sha256(tok)

    pre_path = tmp / "plans" / "pre.json"
    code, out, err = cli(["data", "plan", "--manifest", str(tmp / "shards"), "--unique-tokens", str(20 * 16),
                          "--passes", "prose=2", "--weights", "prose=1", "notes=1", "--row-alignment", "2",
                          "--seq-len", "16", "--dataset", "unit", "--revision", "r1", "--out", str(pre_path)], capsys)
    assert code == 0, err
    pre = load_plan(pre_path)
    assert pre.doc["source_unique_tokens"] == {"notes": 10 * 16, "prose": 10 * 16}
    assert pre.trained_tokens == 30 * 16 and pre.fingerprint in out

    ref_path = tmp / "plans" / "ref.json"
    assert cli(["data", "plan", "--refinement-of", str(pre_path), "--out", str(ref_path)], capsys)[0] == 0
    validate_refinement(load_plan(ref_path), pre)
    code, out, _ = cli(["data", "fingerprint", str(ref_path)], capsys)
    assert code == 0 and out.strip() == pre.fingerprint


@pytest.mark.parametrize(
    "argv, message",
    [
        (["data", "plan", "--manifest", "{shards}", "--unique-tokens", "160", "--dataset", "d", "--revision", "r2",
          "--out", "{pre}"], "refusing to overwrite"),
        (["data", "plan", "--refinement-of", "{pre}", "--dataset", "x", "--out", "{tmp}/r.json"], "drop the build options"),
        (["data", "plan", "--manifest", "{shards}", "--unique-tokens", "160", "--out", "{tmp}/p.json"], "needs --dataset, --revision"),
        (["data", "plan", "--manifest", "{shards}", "--unique-tokens", "160", "--passes", "prose:2", "--dataset", "d",
          "--revision", "r", "--out", "{tmp}/p.json"], "expects SOURCE=VALUE"),
        (["data", "plan", "--manifest", "{shards}", "--unique-tokens", "99999", "--dataset", "d",
          "--revision", "r", "--out", "{tmp}/p.json"], "but its shards hold"),
        (["data", "fingerprint", "{tmp}/missing.json"], "does not exist"),
        (["data", "tokenize", "--input", "{tmp}/missing.txt", "--source", "x", "--tokenizer", "{tok}", "--seq-len", "16",
          "--rows-per-shard", "4", "--out", "{tmp}/s2"], "missing.txt does not exist or is not a file"),
    ],
)
def test_errors_exit_2_with_one_line(inputs, capsys, argv, message):
    tmp, prose, _ = inputs
    tok, shards, pre = tmp / "tok", tmp / "shards", tmp / "pre.json"
    cli(["data", "train-tokenizer", "--input", str(prose), "--vocab-size", "300", "--out", str(tok)], capsys)
    cli(["data", "tokenize", "--input", str(prose), "--source", "prose", "--tokenizer", str(tok), "--seq-len", "16",
         "--rows-per-shard", "4", "--vocab-size", "300", "--out", str(shards)], capsys)
    assert cli(["data", "plan", "--manifest", str(shards), "--unique-tokens", "160", "--dataset", "d", "--revision",
                "r", "--out", str(pre)], capsys)[0] == 0
    code, out, err = cli([a.format(tmp=tmp, tok=tok, shards=shards, pre=pre) for a in argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("ds-trhash data ") and message in err


def test_embedded_command_prints_paths(tmp_path, capsys):
    code, out, _ = cli(["data", "embedded", "--out", str(tmp_path / "demo")], capsys)
    assert code == 0
    paths = json.loads(out)
    assert Path(paths["pretrain_plan"]).is_file() and Path(paths["chat_train_jsonl"]).is_file()
    assert load_plan(paths["refine_plan"]).fingerprint == load_plan(paths["pretrain_plan"]).fingerprint


def test_train_tokenizer_refuses_empty_input_a_vocabulary_over_uint16_and_non_utf8(tmp_path, capsys):
    from ds_trhash.cli import main
    from tests.fail_closed import tree_digest

    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"first line\nna\xefve\n")
    text = tmp_path / "ok.txt"
    text.write_text("hash routed experts\n" * 20)
    before = tree_digest(tmp_path)
    for inputs, vocab, needle in (([empty], "300", "holds no text"),
                                  ([text], "70000", "vocab_size 70000 is too large: token shards store ids as uint16"),
                                  ([text, latin], "300", f"{latin}: line 2 is not UTF-8 text (byte 0xef at column 3)")):
        code = main(["data", "train-tokenizer", "--input", *map(str, inputs), "--vocab-size", vocab,
                     "--out", str(tmp_path / "tok")])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err
    assert tree_digest(tmp_path) == before



def test_train_tokenizer_reads_what_data_tokenize_reads(tmp_path, capsys):
    """Text, JSONL, JSONL.gz and Parquet: the tokenizer learned from the four is the one learned from
    their texts; a bad record is named like `data tokenize` names it and nothing is written."""
    from ds_trhash.data.formats.tokenizer import train_tokenizer
    from tests.data.tokenize_fixtures import write_inputs
    from tests.fail_closed import tree_digest

    files = write_inputs(tmp_path / "in", 80)
    code, out, err = cli(["data", "train-tokenizer", "--input", *map(str, files), "--vocab-size", "300",
                          "--out", str(tmp_path / "tok")], capsys)
    assert code == 0, err
    texts = [files[0]]
    for f in files[1:]:
        code, _, _ = cli(["data", "tokenize", "--input", str(f), "--source", f.name.split(".")[0],
                          "--tokenizer", str(tmp_path / "tok"), "--seq-len", "16", "--rows-per-shard", "4",
                          "--vocab-size", "300", "--out", str(tmp_path / "shards")], capsys)
        assert code == 0
    import gzip
    import pyarrow.parquet as pq
    texts += [json.loads(line)["text"] for line in files[1].read_text().splitlines()]
    texts += [json.loads(line)["text"] for line in gzip.decompress(files[2].read_bytes()).decode().splitlines()]
    texts += pq.read_table(files[3]).column("text").to_pylist()
    expected = train_tokenizer(texts, 300, tmp_path / "expected")
    assert tokenizer_sha256(tmp_path / "tok") == tokenizer_sha256(expected)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    before = tree_digest(tmp_path)
    code, _, err = cli(["data", "train-tokenizer", "--input", str(bad), "--vocab-size", "300",
                        "--out", str(tmp_path / "tok2")], capsys)
    assert code == 2 and f"{bad} line 2: no field 'text'; fix or drop that record" in err, err
    assert tree_digest(tmp_path) == before


def test_train_tokenizer_out_on_an_existing_file_says_so(tmp_path, capsys):
    from tests.fail_closed import tree_digest

    text = tmp_path / "ok.txt"
    text.write_text("hash routed experts\n" * 20)
    before = tree_digest(tmp_path)
    code, _, err = cli(["data", "train-tokenizer", "--input", str(text), "--vocab-size", "300", "--out", str(text)],
                       capsys)
    assert code == 2 and f"--out {text} is a regular file, not a directory; choose a directory path" in err, err
    assert "Errno" not in err and tree_digest(tmp_path) == before


def test_plan_messages_name_the_fix(inputs, capsys):
    """--dataset OWNER/NAME without hf:// is refused; check-refinement of the pretraining plan itself
    points at `data plan --refinement-of`; plans differing only in their dataset string name it."""
    from tests.fail_closed import tree_digest

    tmp, prose, _ = inputs
    tok, shards, pre = tmp / "tok", tmp / "shards", tmp / "pre.json"
    cli(["data", "train-tokenizer", "--input", str(prose), "--vocab-size", "300", "--out", str(tok)], capsys)
    cli(["data", "tokenize", "--input", str(prose), "--source", "prose", "--tokenizer", str(tok), "--seq-len", "16",
         "--rows-per-shard", "4", "--vocab-size", "300", "--out", str(shards)], capsys)
    build = ["data", "plan", "--manifest", str(shards), "--unique-tokens", "160", "--passes", "prose=2",
             "--revision", "r"]
    before = tree_digest(tmp)
    code, _, err = cli([*build, "--dataset", "acme/x", "--out", str(pre)], capsys)
    assert code == 2 and "--dataset 'acme/x' looks like a Hub repository id" in err, err
    assert "hf://datasets/acme/x" in err and "'acme-x'" in err and tree_digest(tmp) == before
    assert cli([*build, "--dataset", "hf://datasets/acme/x", "--out", str(pre)], capsys)[0] == 0
    other = tmp / "pre-other.json"
    assert cli([*build, "--dataset", "hf://datasets/acme/y", "--out", str(other)], capsys)[0] == 0

    code, out, err = cli(["data", "check-refinement", str(pre), "--pretraining", str(pre)], capsys)
    assert code == 2 and "must have exactly one; derive the refinement plan from the pretraining plan with " \
                         "`ds-trhash data plan --refinement-of PRE.json --out REF.json`" in out + err, out + err
    ref = tmp / "ref.json"
    assert cli(["data", "plan", "--refinement-of", str(other), "--out", str(ref)], capsys)[0] == 0
    code, out, err = cli(["data", "check-refinement", str(ref), "--pretraining", str(pre)], capsys)
    text = out + err
    assert code == 2 and "the plans differ in dataset 'hf://datasets/acme/y' vs 'hf://datasets/acme/x'" in text, text
    assert "unique core's sources" not in text
