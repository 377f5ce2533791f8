"""Pretraining on a corpus in the release's layout (docs/contracts.md §2b), through the real entry
point: the same rows as in our layout give the same losses; the corpus records no tokenizer, so
the launch says once that it assumes data.tokenizer and records it; a plan and manifest naming a
shard outside the corpus, or a source `../docs`, are refused before the model with nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_trhash.data.plans.plan import write_plan
from ds_trhash.data.plans.build import build_plan
from ds_trhash.data.formats.shards import load_manifests
from ds_trhash.data.formats.tokenizer import tokenizer_sha256
from tests.data.layout_fixtures import edit_json, our_corpus, release_copy
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e
SEQ, ROWS = 128, 12  # 12 rows of each of two sources: 3 steps of 8 rows


def _args(out: Path, plan: Path, shards: Path, tok: Path, cache: Path) -> list[str]:
    return ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "3",
            "--set", "checkpoint.every_steps=3", "--set", "checkpoint.packs=null", "--set", "training.log_every=1",
            "--set", f"data.plan={plan}", "--set", f"data.shards_dir={shards}", "--set", f"data.tokenizer={tok}",
            "--set", f"data.cache_dir={cache}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("release-layout")
    tok = root / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"stand-in": "tokenizer bytes; pretraining only hashes them"}')
    ours = our_corpus(root / "ours", docs=4, tokens=400, seq_len=SEQ, rows_per_shard=4, vocab_size=4096,
                      tokenizer_hash=tokenizer_sha256(tok))
    release = release_copy(ours, root / "release")
    plans = {}
    for name, corpus in (("ours", ours), ("release", release)):
        doc = build_plan(load_manifests([corpus]), None, dataset=f"hf://datasets/o/{name}", revision="main",
                         source_budgets={"alpha": ROWS * SEQ, "beta": ROWS * SEQ})
        plans[name] = write_plan(doc, root / f"{name}.json").path
    procs = {name: L.single(_args(root / f"run-{name}", plans[name], corpus, tok, root / f"cache-{name}"))
             for name, corpus in (("ours", ours), ("release", release))}
    for proc in procs.values():
        assert proc.returncode == 0, L.explain(proc)
    return root, tok, plans, procs


def test_the_release_layout_trains_with_the_losses_of_the_same_rows_in_ours(runs):
    root, _, plans, _ = runs
    assert json.loads(plans["release"].read_text())["phases"][0]["sources"]["alpha"][0]["file"] == "tokens-00000.bin"
    ours, release = L.train_losses(root / "run-ours"), L.train_losses(root / "run-release")
    assert len(ours) == 3 and ours == release


def test_a_corpus_without_tokenizer_identity_takes_data_tokenizer_says_so_once_and_records_it(runs):
    root, tok, _, procs = runs
    said = [line for line in procs["release"].stderr.splitlines() if "record no tokenizer identity" in line]
    assert len(said) == 1 and f"assuming data.tokenizer {tok}" in said[0], L.explain(procs["release"])
    assert "record no tokenizer identity" not in procs["ours"].stderr
    for name, assumed in (("release", True), ("ours", False)):
        state = json.loads((root / f"run-{name}" / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
        assert (state["tokenizer_sha256"], state["tokenizer_assumed"]) == (tokenizer_sha256(tok), assumed)


@pytest.mark.parametrize("hostile, needle", [
    ("file", "field 'phases[0].sources.alpha[0].file' is '../../../victim.bin'"),
    ("source", "field 'phases[0].sources' is '../docs'"),
])
def test_a_hostile_plan_and_manifest_are_refused_before_the_model_and_nothing_changes(runs, hostile, needle):
    root, tok, plans, _ = runs
    bad = root / f"hostile-{hostile}"
    if not bad.exists():
        release = release_copy(root / "ours", bad / "corpus")
        doc = json.loads(plans["release"].read_text())
        core = doc["phases"][0]["sources"]
        if hostile == "file":  # the manifest names it too, with the victim's size and hash
            (root / "victim.bin").write_bytes((release / "corpora" / "alpha" / "tokens-00000.bin").read_bytes())
            edit_json(release / "corpora" / "alpha" / "manifest.json",
                      lambda d: d["shards"][0].update(file="../../../victim.bin"))
            core["alpha"][0]["file"] = "../../../victim.bin"
        else:
            core["../docs"] = core.pop("alpha")
        (bad / "plan.json").write_text(json.dumps(doc))
    before = tree_digest(root)
    proc = L.single(_args(bad / "run", bad / "plan.json", bad / "corpus", tok, bad / "cache"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, L.explain(proc)
    assert f"replay plan {bad / 'plan.json'} {needle}" in proc.stderr, L.explain(proc)
    assert "building the model" not in proc.stderr
    assert tree_digest(root) == before
