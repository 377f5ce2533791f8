"""Fixtures of the preflight and smoke tests: the demo corpus and one session of runs."""
from __future__ import annotations

import pytest

from tests.prelaunch.runs import run_all


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The demo corpus (tokenizer, shards, pretraining and refinement plans), its SFT set, and
    the same corpus under another tokenizer (vocabulary 4000)."""
    from ds_trhash.data.embedded import build_embedded
    from ds_trhash.data.sft.build import build_sft_dataset

    root = tmp_path_factory.mktemp("corpus")
    paths = build_embedded(root / "data", seq_len=128)
    build_sft_dataset(paths.chat_train_jsonl, paths.chat_eval_jsonl, paths.tokenizer_dir, 128, root / "sft")
    other = build_embedded(root / "data_other_tokenizer", seq_len=128, vocab_size=4000)
    return {"root": root, "paths": paths, "sft": root / "sft", "other": other}


@pytest.fixture(scope="session")
def prelaunch_runs(tmp_path_factory, corpus):
    """Every preflight case, the smoke of the tiny config (4 steps) and a failing smoke."""
    return run_all(tmp_path_factory.mktemp("prelaunch"), corpus)
