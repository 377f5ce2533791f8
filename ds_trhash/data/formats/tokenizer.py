"""Byte-level BPE tokenizer: training, loading, and the hash that names it.

Shards, SFT sets and checkpoints record which tokenizer produced their ids; the identity
used everywhere is the SHA-256 of the exact ``tokenizer.json`` bytes, so two tokenizers
that merely look alike never pass for each other.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds_trhash.errors import UserError
from ds_trhash.io import read_utf8, sha256_file

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN, UNK_TOKEN = "</s>", "<pad>", "<s>", "<unk>"
EOS_ID, PAD_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
# Order matters: the trainer assigns ids in list order, and docs/contracts.md §5 fixes these ids.
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN, UNK_TOKEN)
BYTE_ALPHABET_SIZE = 256
MAX_VOCAB = 2**16  # token shards are uint16 (formats/shards.py MAX_TOKEN_ID + 1)

PathLike = Union[str, "os.PathLike[str]"]


class TokenizerError(UserError, ValueError):
    """A tokenizer file is missing, malformed, or has the wrong special-token ids."""


def _texts_from(source: Iterable[object]) -> Iterator[str]:
    """Yield training texts: whole files for path objects, the strings themselves otherwise.

    Plain ``str`` items are texts, never file names; pass ``Path`` objects for files so a
    list of file names is not silently trained on as text.
    """
    for item in source:
        if isinstance(item, os.PathLike):
            path = Path(item)
            if not path.is_file():
                raise TokenizerError(f"tokenizer training input {path} is not a file; pass existing text files")
            yield read_utf8(path, TokenizerError)
        elif isinstance(item, str):
            yield item
        else:
            raise TokenizerError(
                f"tokenizer training input of type {type(item).__name__} is neither a path nor a text; "
                "pass pathlib.Path objects for files or str for texts"
            )


def train_tokenizer(source: Iterable[object], vocab_size: int, out_dir: PathLike, *, overwrite: bool = False) -> Path:
    """Train a byte-level BPE on files (``Path`` items) or texts (``str`` items).

    Returns the path of the written ``tokenizer.json``. Byte-level means every byte has a
    token, so ``<unk>`` exists only to keep the fixed special-id layout. An existing
    tokenizer is never replaced unless ``overwrite``: shards, plans and checkpoints record its
    hash, and a new one under the same path would silently change what their token ids mean.
    """
    existing = Path(out_dir) / TOKENIZER_FILE
    if existing.exists() and not overwrite:
        raise TokenizerError(
            f"{existing} already exists (sha256 {tokenizer_sha256(existing)[:12]}…); data made with it records "
            "that hash. Write the new tokenizer to another --out, or pass --overwrite to replace it")
    minimum = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE
    if vocab_size < minimum:
        raise TokenizerError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {minimum}")
    if vocab_size > MAX_VOCAB:
        raise TokenizerError(f"vocab_size {vocab_size} is too large: token shards store ids as uint16, so at most "
                             f"{MAX_VOCAB} tokens fit; pass --vocab-size {MAX_VOCAB} or less")
    seen = {"chars": 0}

    def counted(texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            seen["chars"] += len(text.strip())
            yield text

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(counted(_texts_from(source)), trainer=trainer)
    if not seen["chars"]:
        raise TokenizerError("the tokenizer training input holds no text (empty files or only whitespace); "
                             "pass the text files to learn the vocabulary from")
    check_special_ids(tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / TOKENIZER_FILE
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, path)
    return path


def check_special_ids(tokenizer: Tokenizer) -> None:
    """Fail unless the docs/contracts.md §5 special tokens sit at ids 0..3."""
    for expected, token in enumerate(SPECIAL_TOKENS):
        actual = tokenizer.token_to_id(token)
        if actual != expected:
            raise TokenizerError(
                f"special token {token!r} has id {actual}, SPEC requires {expected}; "
                "retrain the tokenizer with train_tokenizer or use the released one"
            )


def tokenizer_file(path_or_dir: PathLike) -> Path:
    """Resolve a directory holding tokenizer.json, or the file itself, to the file."""
    path = Path(path_or_dir)
    if path.is_dir():
        candidate = path / TOKENIZER_FILE
        if not candidate.is_file():
            raise TokenizerError(f"directory {path} has no {TOKENIZER_FILE}; pass the directory train_tokenizer wrote")
        return candidate
    if path.is_file():
        return path
    raise TokenizerError(f"tokenizer path {path} does not exist; pass a directory holding {TOKENIZER_FILE} or the file")


def load_tokenizer(path_or_dir: PathLike, *, require_special_ids: bool = True) -> Tokenizer:
    """Load a tokenizer, checking the special-token ids the trainer relies on (EOS = 0)."""
    path = tokenizer_file(path_or_dir)
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on parse errors
        raise TokenizerError(f"{path} is not a valid tokenizers JSON file: {exc}") from exc
    if require_special_ids:
        check_special_ids(tokenizer)
    return tokenizer


def tokenizer_sha256(path_or_dir: PathLike) -> str:
    """SHA-256 hex digest of the tokenizer.json bytes: the tokenizer's identity."""
    return sha256_file(tokenizer_file(path_or_dir))
