"""The data check preflight shares with the launch, on a corpus in the release's layout: it passes
and says the corpus records no tokenizer; a changed shard there is named by its path."""

from pathlib import Path

import pytest

from ds_trhash.data.plans.plan import write_plan
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.formats.shards import load_manifests
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from ds_trhash.prelaunch.data_check import resolve_stage_data
from ds_trhash.training import config as tcfg
from ds_trhash.data.stream.corpus import CorpusError
from tests.data.layout_fixtures import our_corpus, release_copy
from tests.fail_closed import tree_digest

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path, plan, shards, tok):
    overrides = [f"data.plan={plan}", f"data.shards_dir={shards}", f"data.tokenizer={tok}",
                 f"output_dir={tmp_path / 'run'}", "training.max_steps=2"]
    cfg = tcfg.load_config(REPO / "ds_configs/tiny/pretrain.yaml", overrides)
    return cfg, tcfg.model_config(cfg)


@pytest.fixture()
def release(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"stand-in": 1}')
    ours = our_corpus(tmp_path / "ours", docs=2, tokens=600, seq_len=128, rows_per_shard=4, vocab_size=4096,
                      tokenizer_hash=tokenizer_sha256(tok))
    corpus = release_copy(ours, tmp_path / "release")
    doc = build_plan(load_manifests([corpus]), None, dataset="hf://datasets/o/r", revision="main",
                     source_budgets={"alpha": 8 * 128, "beta": 8 * 128})
    return corpus, write_plan(doc, tmp_path / "plan.json").path, tok


def test_preflight_data_check_passes_on_the_release_layout_and_says_the_tokenizer_is_assumed(release, tmp_path):
    corpus, plan, tok = release
    cfg, model_cfg = _config(tmp_path, plan, corpus, tok)
    data, said = resolve_stage_data(cfg, 1, deep=True, scratch=tmp_path / "scratch")
    assert "every shard it reads matches its manifest's sizes and SHA-256" in said
    assert f"record no tokenizer identity; assuming data.tokenizer {tok}" in said
    assert data.tokenizer_assumed and data.tokenizer_sha256 == tokenizer_sha256(tok)
    assert "(release layout)" in data.describe


def test_a_changed_shard_of_the_release_layout_is_named_and_nothing_is_written(release, tmp_path):
    corpus, plan, tok = release
    shard = corpus / "corpora" / "beta" / "tokens-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[7] ^= 0xFF
    shard.write_bytes(bytes(raw))
    cfg, model_cfg = _config(tmp_path, plan, corpus, tok)
    before = tree_digest(tmp_path)
    with pytest.raises(CorpusError, match="corpora/beta/tokens-00001.bin has sha256 [0-9a-f]{64}, its manifest"):
        resolve_stage_data(cfg, 1, deep=True, scratch=tmp_path / "scratch")
    assert tree_digest(tmp_path) == before


def test_without_data_tokenizer_the_run_records_none_and_says_so(release, tmp_path):
    corpus, plan, _ = release
    overrides = [f"data.plan={plan}", f"data.shards_dir={corpus}", f"output_dir={tmp_path / 'run'}",
                 "training.max_steps=2"]
    cfg = tcfg.load_config(REPO / "ds_configs/tiny/pretrain.yaml", overrides)
    data, said = resolve_stage_data(cfg, 1, deep=False, scratch=tmp_path / "scratch")
    assert data.tokenizer_sha256 is None and not data.tokenizer_assumed
    assert "data.tokenizer is not set: this run records no tokenizer" in said
