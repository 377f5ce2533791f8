"""A local corpus of either layout: read, checked against a plan, and refused when a name or a
symlink would leave it, through the readers and the real `ds-trhash data plan` command."""

import json
import os
import shutil

import pytest

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.cli import main
from ds_trhash.data.formats.layout import LAYOUT_OURS, LAYOUT_RELEASE, read_corpus, sources_dir
from ds_trhash.data.formats.manifest import LEGACY_FORMAT, ManifestError
from ds_trhash.data.plans.plan import load_plan
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.data.formats.shards import load_manifest, load_manifests
from ds_trhash.data.stream.store import StoreError
from ds_trhash.data.stream.corpus import open_corpus
from tests.data.layout_fixtures import L, edit_json, our_corpus, release_copy
from tests.fail_closed import tree_digest


@pytest.fixture()
def corpora(tmp_path):
    ours = our_corpus(tmp_path / "ours")
    return ours, release_copy(ours, tmp_path / "release")


def _plan(manifests, **kw):
    return build_plan(manifests, None, dataset="local", revision="r0", source_budgets={"alpha": 8 * L, "beta": 8 * L},
                      **kw)


def test_both_layouts_read_to_the_same_sources_and_rows(corpora):
    ours, release = corpora
    a, b = read_corpus(ours), read_corpus(release)
    assert (a.layout, a.sources_dir, b.layout, b.sources_dir) == (LAYOUT_OURS, ours, LAYOUT_RELEASE, release / "corpora")
    assert sources_dir(release) == release / "corpora" and sources_dir(ours) == ours
    assert {n: m.rows for n, m in a.sources.items()} == {n: m.rows for n, m in b.sources.items()}
    assert b.mixture.rows == sum(m.rows for m in b.sources.values()) and b.sources["alpha"].tokenizer_sha256 is None
    assert a.sources["alpha"].tokenizer_sha256 == "t" * 64
    assert set(load_manifests([release])) == {"alpha", "beta"} == set(load_manifests([release / "corpora" / "alpha",
                                                                                      release / "corpora" / "beta"]))


def test_our_written_manifest_is_a_superset_of_the_releases_and_old_manifests_still_load(corpora):
    ours, _ = corpora
    doc = json.loads((ours / "alpha" / "manifest.json").read_text())
    release_fields = {"format", "source", "weight", "seq_len", "dtype", "rows", "trained_tokens",
                      "source_tokens_consumed", "shards"}
    assert release_fields <= set(doc) and doc["format"] == "tr-hash-token-mixture-v1" and doc["dtype"] == "uint16"
    assert doc["trained_tokens"] == doc["rows"] * L and {"tokenizer_sha256", "vocab_size"} <= set(doc)
    # a manifest as the writer wrote it before this format: shards-v1, "<u2", total_rows, no rows
    old = {k: v for k, v in doc.items() if k not in ("weight", "rows", "trained_tokens", "source_tokens_consumed")}
    old.update(format=LEGACY_FORMAT, dtype="<u2")
    (ours / "alpha" / "manifest.json").write_text(json.dumps(old))
    loaded = load_manifest(ours / "alpha")
    assert (loaded.format, loaded.rows, loaded.tokenizer_sha256) == (LEGACY_FORMAT, doc["rows"], "t" * 64)
    assert read_corpus(ours).sources["alpha"].rows == doc["rows"]


def test_a_plan_over_the_release_layout_reads_the_same_rows_as_over_ours(corpora):
    ours, release = corpora
    plan_ours, plan_release = _plan(load_manifests([ours])), _plan(load_manifests([release]))
    assert plan_release.get("tokenizer_sha256") is None and plan_ours["tokenizer_sha256"] == "t" * 64
    corpus = open_corpus(plan_release, str(release))  # every planned shard listed with its size
    assert corpus.layout == LAYOUT_RELEASE and len(corpus.shards) == len(open_corpus(plan_ours, str(ours)).shards)
    a, b = ReplayReader(plan_ours, ours, seed=3), ReplayReader(plan_release, release, seed=3)
    layout = BatchLayout(micro_batch=8, grad_accum=1, rank=0, world_size=1)
    for step in range(2):
        assert all((x == y).all() for x, y in zip(a.batch(step, 0, layout), b.batch(step, 0, layout)))


def test_release_cross_file_rules_name_the_file(corpora):
    _, release = corpora
    edit_json(release / "mixture_manifest.json", lambda d: d["sources"][0].update(rows=99))
    with pytest.raises(ManifestError, match="mixture_manifest.json field 'rows' of source 'alpha' is 99"):
        read_corpus(release)
    edit_json(release / "mixture_manifest.json", lambda d: d["sources"][0].update(rows=6))
    with pytest.raises(ManifestError, match="reads source\\(s\\) 'gamma', which .* does not list"):
        read_corpus(release, ["gamma"], origin="plan.json")
    edit_json(release / "corpora" / "beta" / "manifest.json", lambda d: d.update(seq_len=16))
    with pytest.raises(ManifestError, match="beta/manifest.json field 'seq_len' is 16, but the mixture manifest says 8"):
        read_corpus(release)  # named before its shards' tokens, which a wrong seq_len would all fail


def test_a_shard_symlinked_out_of_the_corpus_is_a_launch_problem(corpora, tmp_path):
    ours, _ = corpora
    plan = _plan(load_manifests([ours]))
    victim = tmp_path / "victim.bin"
    shutil.copy(ours / "alpha" / "shard-00000.bin", victim)
    (ours / "alpha" / "shard-00000.bin").unlink()
    os.symlink(victim, ours / "alpha" / "shard-00000.bin")
    with pytest.raises(StoreError, match="alpha/shard-00000.bin is a symlink that leads outside the store"):
        open_corpus(plan, str(ours))


def test_data_plan_builds_over_the_release_layout_through_the_command(corpora, tmp_path, capsys):
    _, release = corpora
    out = tmp_path / "plan.json"
    assert main(["data", "plan", "--manifest", str(release), "--source-tokens", f"alpha={8 * L}",
                 f"beta={8 * L}", "--dataset", "hf://datasets/o/synthetic", "--revision", "main",
                 "--out", str(out)]) == 0
    plan = load_plan(out)
    assert plan.doc["phases"][0]["sources"]["alpha"][0]["file"] == "tokens-00000.bin"
    assert plan.trained_tokens == 16 * L


def _hostile(tmp_path, name):
    """A corpus whose manifest and plan both name ``name`` for a shard, its size and hash made to match."""
    ours = our_corpus(tmp_path / "shards")
    plan = _plan(load_manifests([ours]))
    victim = tmp_path / "victim.bin"
    shutil.copy(ours / "alpha" / "shard-00000.bin", victim)
    edit_json(ours / "alpha" / "manifest.json", lambda d: d["shards"][0].update(file=name))
    plan["phases"][0]["sources"]["alpha"][0]["file"] = name
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return ours


def _refused(capsys, *argv) -> str:
    """``ds-trhash ARGV`` through the CLI's entry point: exit 2 and one line on stderr."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_hostile_shard_name_is_refused_by_the_real_commands_and_nothing_changes(tmp_path, capsys):
    shards = _hostile(tmp_path, "../../victim.bin")
    before = tree_digest(tmp_path)
    err = _refused(capsys, "data", "plan", "--manifest", shards, "--source-tokens", f"alpha={8 * L}",
                   f"beta={8 * L}", "--dataset", "d", "--revision", "r", "--out", tmp_path / "new.json")
    assert f"{shards / 'alpha' / 'manifest.json'} field 'shards[0].file'" in err and "without a directory part" in err
    err = _refused(capsys, "data", "fingerprint", tmp_path / "plan.json")
    assert "field 'phases[0].sources.alpha[0].file'" in err and "'../../victim.bin'" in err
    assert tree_digest(tmp_path) == before


def test_a_manifest_whose_seq_len_is_a_string_is_refused_by_the_command(tmp_path, capsys):
    shards = our_corpus(tmp_path / "shards")
    edit_json(shards / "beta" / "manifest.json", lambda d: d.update(seq_len="8"))  # once accepted as is
    before = tree_digest(tmp_path)
    err = _refused(capsys, "data", "plan", "--manifest", shards, "--unique-tokens", "64", "--dataset", "d",
                   "--revision", "r", "--out", tmp_path / "plan.json")
    assert f"{shards / 'beta' / 'manifest.json'} field 'seq_len' is '8' (a string)" in err
    assert tree_digest(tmp_path) == before
