"""The data's own check of a launch's tokenizer against the corpus (moved from training/launch)."""
import pytest

from ds_trhash.data.formats.tokenizer_check import TokenizerMismatch, check_tokenizer_matches, data_tokenizer_identity


def test_tokenizer_identity_names_every_disagreeing_record(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    from ds_trhash.data.formats.tokenizer import tokenizer_sha256

    ours = tokenizer_sha256(tmp_path)
    check_tokenizer_matches(tmp_path, {"the plan": ours, "the web shard manifest": None})
    with pytest.raises(TokenizerMismatch, match="the web shard manifest records 000000000000"):
        check_tokenizer_matches(tmp_path, {"the plan": ours, "the web shard manifest": "0" * 64})


def test_the_identity_is_the_datas_own_record_else_the_configured_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    from ds_trhash.data.formats.tokenizer import tokenizer_sha256

    ours = tokenizer_sha256(tmp_path)
    assert data_tokenizer_identity({"the plan": "a" * 64}, tmp_path, "corpus") == ("a" * 64, False, ())
    identity, assumed, notes = data_tokenizer_identity({"the plan": None}, tmp_path, "corpus")
    assert (identity, assumed) == (ours, True) and "assuming data.tokenizer" in notes[0]
    assert data_tokenizer_identity({"the plan": None}, None, "corpus")[:2] == (None, False)
