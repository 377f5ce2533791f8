"""Whether a launch's tokenizer is the one its data was tokenized with, and which identity a run records.

The data owns this check: a plan and every source manifest record the SHA-256 of the tokenizer that
made their ids, and a model trained on ids of another vocabulary trains on garbage without an error.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from ds_trhash.data.formats.tokenizer import TokenizerError, tokenizer_file, tokenizer_sha256


class TokenizerMismatch(TokenizerError):
    """``data.tokenizer`` is not the tokenizer the data records."""


def check_tokenizer_matches(tokenizer: str | os.PathLike | None, recorded: Mapping[str, str | None]) -> None:
    """``data.tokenizer`` must be the tokenizer the data was made with: every recorded hash
    (plan, each source's shard manifest) must equal the file's SHA-256."""
    if tokenizer is None:
        return
    try:
        actual = tokenizer_sha256(tokenizer)
    except (OSError, TokenizerError) as exc:  # unreadable, or not a tokenizer: a bug keeps its traceback
        raise TokenizerMismatch(f"data.tokenizer {tokenizer}: {exc}") from None
    wrong = {what: h for what, h in recorded.items() if h and h != actual}
    if wrong:
        listing = ", ".join(f"{what} records {h[:12]}…" for what, h in wrong.items())
        raise TokenizerMismatch(
            f"data.tokenizer {tokenizer_file(tokenizer)} has sha256 {actual[:12]}…, but {listing}; "
            "point data.tokenizer at the tokenizer the data was made with, or rebuild the data")


def data_tokenizer_identity(recorded: Mapping[str, str | None], tokenizer_dir: str | os.PathLike | None,
                            described: str) -> tuple[str | None, bool, tuple[str, ...]]:
    """(the tokenizer identity of the data, whether it was assumed, what to say once).

    The data's own record wins (``check_tokenizer_matches`` already compared it with
    data.tokenizer). A corpus that records none (the release's manifests never do) is taken to
    be tokenized with the configured data.tokenizer, and the launch says so."""
    known = next((h for h in recorded.values() if h), None)
    if known is not None and tokenizer_dir is None:
        return known, False, (f"the data records tokenizer {known[:12]}… but data.tokenizer is not set: final/ and "
                              "exports of this run will carry no tokenizer.json (generate and the run record need "
                              "it); set data.tokenizer to the directory the data was tokenized with",)
    if known is not None:
        return known, False, ()
    if tokenizer_dir is None:
        return None, False, (f"the corpus at {described} and its plan record no tokenizer identity and data.tokenizer "
                             "is not set: this run records no tokenizer",)
    actual = tokenizer_sha256(tokenizer_dir)
    return actual, True, (f"the corpus at {described} and its plan record no tokenizer identity; assuming "
                          f"data.tokenizer {tokenizer_dir} (sha256 {actual[:12]}…), recorded as this run's tokenizer",)
