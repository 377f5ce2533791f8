"""The `sft build` / `sft validate` subcommands as the single CLI will run them."""
import json

from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.cli import main as _run  # the real command line: its one handler prints a refusal


def _inputs(tmp_path, bad=()):
    train = write_jsonl(tmp_path / "train.jsonl", [{"messages": conversation(i)} for i in range(4)] + list(bad))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"messages": conversation(9)}])
    return str(train), str(evaluation)


def test_build_then_validate(tmp_path, tokenizer_dir, capsys):
    train, evaluation = _inputs(tmp_path, bad=['{"broken'])
    out = tmp_path / "sft"
    argv = ["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
            "--seq-len", "256", "--out", str(out), "--drop-invalid", "--source-name", "demo", "--revision", "v2"]
    assert _run(argv) == 0
    printed = capsys.readouterr().out
    assert "train: 4 examples" in printed and "dropped 1 invalid: invalid_json=1" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"][0]["name"] == "demo" and manifest["sources"][0]["revision"] == "v2"
    validate = ["sft", "validate", str(out), "--vocab-size", str(VOCAB_SIZE), "--seq-len", "256", "--tokenizer", str(tokenizer_dir)]
    assert _run(validate) == 0
    assert "is valid" in capsys.readouterr().out


def test_invalid_input_exits_2_with_the_listing_on_stderr(tmp_path, tokenizer_dir, capsys):
    train, evaluation = _inputs(tmp_path, bad=['{"broken'])
    argv = ["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
            "--seq-len", "256", "--out", str(tmp_path / "sft")]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 1 invalid SFT example(s):") and "train.jsonl:5: not valid JSON" in err
    assert not (tmp_path / "sft").exists()


def test_validate_with_another_tokenizer_exits_2(tmp_path, tokenizer_dir, capsys):
    train, evaluation = _inputs(tmp_path)
    out = str(tmp_path / "sft")
    assert _run(["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
                 "--seq-len", "256", "--out", out]) == 0
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text() + "\n")
    capsys.readouterr()
    assert _run(["sft", "validate", out, "--vocab-size", str(VOCAB_SIZE), "--seq-len", "256", "--tokenizer", str(other)]) == 2
    assert "different tokenizer" in capsys.readouterr().err
    assert _run(["sft", "validate", out, "--vocab-size", "32000", "--seq-len", "256"]) == 2
    assert "'vocab_size' is 512, expected 32000" in capsys.readouterr().err


def test_an_extra_key_in_a_message_is_refused_and_nothing_is_built(tmp_path, tokenizer_dir, capsys):
    from tests.fail_closed import tree_digest

    extra = {"messages": [{"role": "user", "content": "hi", "name": "ada"}, {"role": "assistant", "content": "hello"}]}
    train, evaluation = _inputs(tmp_path, bad=[json.dumps(extra)])
    before = tree_digest(tmp_path)
    argv = ["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
            "--seq-len", "256", "--out", str(tmp_path / "sft")]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "train.jsonl:5: message 0 has key(s) 'name'; a message holds only role and content" in err
    assert tree_digest(tmp_path) == before


def test_a_line_that_is_not_utf8_names_the_file_and_line_and_nothing_is_built(tmp_path, tokenizer_dir, capsys):
    from ds_trhash.cli import main
    from tests.fail_closed import tree_digest

    train, evaluation = _inputs(tmp_path)
    with open(train, "ab") as f:
        f.write(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    before = tree_digest(tmp_path)
    argv = ["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
            "--seq-len", "256", "--out", str(tmp_path / "sft")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{train}: line 5 is not UTF-8 text (byte 0xe9 at column" in err and "Traceback" not in err, err
    assert tree_digest(tmp_path) == before


def test_several_invalid_examples_are_listed_one_per_line(tmp_path, tokenizer_dir, capsys):
    bad = ['{"broken', '{"messages": []}', '[1, 2]', '{"messages": [{"role": "user", "content": "hi"}]}']
    train, evaluation = _inputs(tmp_path, bad=bad)
    argv = ["sft", "build", "--input", train, "--eval-input", evaluation, "--tokenizer", str(tokenizer_dir),
            "--seq-len", "256", "--out", str(tmp_path / "sft")]
    assert _run(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("error: 4 invalid SFT example(s): fix or remove them, or rebuild with --drop-invalid")
    assert len(lines) == 5 and all(line.startswith("  ") and "train.jsonl:" in line for line in lines[1:]), lines
    assert not (tmp_path / "sft").exists()
