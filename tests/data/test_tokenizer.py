import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from ds_trhash.data.formats.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerError,
    load_tokenizer,
    tokenizer_file,
    tokenizer_sha256,
    train_tokenizer,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Replay plans select rows of token shards; refinement sees each row once.",
    "Hash routing assigns every token id to two experts. Ünïcödé survives bytes.",
] * 20


def test_trained_tokenizer_has_spec_special_ids_and_round_trips(tmp_path):
    path = train_tokenizer(TEXTS, 320, tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    tok = load_tokenizer(tmp_path / "tok")
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.get_vocab_size() <= 320
    text = "Ünïcödé routes tokens, never seen: ∮ 🦊"
    assert tok.decode(tok.encode(text).ids) == text  # byte level: nothing is unknown
    assert 3 not in tok.encode(text).ids


def test_trains_from_path_objects_and_treats_str_items_as_text(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS), encoding="utf-8")
    from_file = train_tokenizer([corpus], 300, tmp_path / "a")
    from_text = train_tokenizer(["\n".join(TEXTS)], 300, tmp_path / "b")
    assert json.loads(from_file.read_text())["model"]["vocab"] == json.loads(from_text.read_text())["model"]["vocab"]
    # A str is a text, never a file name: training on the file's name yields a different vocabulary.
    by_name = train_tokenizer([str(corpus)], 300, tmp_path / "c")
    assert json.loads(by_name.read_text())["model"]["vocab"] != json.loads(from_file.read_text())["model"]["vocab"]


def test_training_rejects_bad_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="too small"):
        train_tokenizer(TEXTS, 100, tmp_path)
    with pytest.raises(TokenizerError, match="not a file"):
        train_tokenizer([tmp_path / "missing.txt"], 300, tmp_path)
    with pytest.raises(TokenizerError, match="neither a path nor a text"):
        train_tokenizer([b"bytes"], 300, tmp_path)


def test_load_accepts_dir_or_file_and_explains_missing(tmp_path):
    path = train_tokenizer(TEXTS, 300, tmp_path / "tok")
    assert tokenizer_file(tmp_path / "tok") == path
    assert load_tokenizer(path).token_to_id("</s>") == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")


def test_load_rejects_wrong_special_ids(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False)
    tok.train_from_iterator(TEXTS, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"'</s>' has id 2, SPEC requires 0"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(tmp_path, require_special_ids=False).token_to_id("</s>") == 2


def test_hash_is_sha256_of_file_bytes_and_tracks_content(tmp_path):
    path = train_tokenizer(TEXTS, 300, tmp_path / "a")
    assert tokenizer_sha256(tmp_path / "a") == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert tokenizer_sha256(path) == tokenizer_sha256(tmp_path / "a")
    other = train_tokenizer(TEXTS, 310, tmp_path / "b")
    assert tokenizer_sha256(other) != tokenizer_sha256(path)
