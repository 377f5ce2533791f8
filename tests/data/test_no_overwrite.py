"""`ds-trhash data train-tokenizer` never replaces a tokenizer that data may already depend on."""

from tests.fail_closed import assert_clean_refusal, ds_trhash, tree_digest


def test_train_tokenizer_refuses_an_existing_tokenizer_unless_overwrite(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} about hashed experts and replay plans" for i in range(200)))
    out = tmp_path / "tok"
    first = ds_trhash("data", "train-tokenizer", "--input", corpus, "--vocab-size", "300", "--out", out)
    assert first.returncode == 0, first.stderr
    before = tree_digest(tmp_path)
    again = ds_trhash("data", "train-tokenizer", "--input", corpus, "--vocab-size", "320", "--out", out)
    assert_clean_refusal(again, f"{out / 'tokenizer.json'} already exists", "--overwrite")
    assert tree_digest(tmp_path) == before
    forced = ds_trhash("data", "train-tokenizer", "--input", corpus, "--vocab-size", "320", "--out", out, "--overwrite")
    assert forced.returncode == 0, forced.stderr
    assert tree_digest(tmp_path)[str("tok/tokenizer.json")] != before["tok/tokenizer.json"]
