"""The release's plan builder (docs/contracts.md §2c): `ds-trhash data plan` over the release corpus's
manifests and budgets rebuilds the released plan byte for byte, reading no shard; quality scores
order the shards; every refusal names the numbers and writes nothing."""
import json

import pytest

from ds_trhash.cli import main
from ds_trhash.data.plans.corpus_index import read_corpus_index
from ds_trhash.data.plans.plan import PlanError, load_plan
from ds_trhash.data.plans.build import build_plan, score_key
from tests.data.release_corpus import (
    BUDGETS, DATASET, FULL_ROWS, PASSES, PHASE2, RELEASED, REPLAY, REVISION, SHORT_TAIL_ROWS, write_release_corpus,
    write_release_layout,
)
from tests.fail_closed import tree_digest

FINGERPRINT = "b8549c92137b7ee14c01229ec2569afc153299dedc69109a8856adf4d4547d98"


def release_args(corpus, out, *extra):
    return ["data", "plan", "--manifest", str(corpus),
            "--source-tokens", *[f"{s}={b * 10**9}" for s, b in BUDGETS.items()],
            "--passes", *[f"{s}={p}" for s, p in PASSES.items()],
            "--row-alignment", "512", "--dataset", DATASET, "--revision", REVISION, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_release_corpus(tmp_path_factory.mktemp("release") / "corpus")


def test_data_plan_rebuilds_the_released_plan_exactly_from_manifests_alone(corpus, tmp_path, capsys):
    assert not list(corpus.rglob("*.bin"))  # no shard exists: only manifests can have been read
    out = tmp_path / "rebuilt.json"
    assert main(release_args(corpus, out)) == 0
    printed = capsys.readouterr().out
    assert f"fingerprint {FINGERPRINT}" in printed and "'quality_replay_2', 'quality_replay_3'" in printed
    released = RELEASED / REPLAY
    assert json.loads(out.read_text()) == json.loads(released.read_text())
    assert out.read_bytes() == released.read_bytes()  # same key order and layout too
    rebuilt = load_plan(out)
    assert rebuilt.fingerprint == FINGERPRINT and rebuilt.trained_tokens == 129_995_112_448
    # ... and its refinement is the released phase-two plan, byte for byte.
    assert main(["data", "plan", "--refinement-of", str(out), "--out", str(tmp_path / "phase2.json")]) == 0
    assert (tmp_path / "phase2.json").read_bytes() == (RELEASED / PHASE2).read_bytes()


def test_the_release_corpus_index_is_what_the_plans_name(corpus):
    index = read_corpus_index([corpus])
    assert index.seq_len == 1024 and list(index.sources) == list(BUDGETS) and index.identity == {}
    assert [len(index.sources[s]) for s in BUDGETS] == [21, 35, 12, 7, 7, 10]  # named shards + a short tail
    assert {shard.rows for s in BUDGETS for shard in index.sources[s][:-1]} == {FULL_ROWS}
    assert index.sources["dclm"][-1].rows == SHORT_TAIL_ROWS
    # the mixture_manifest.json file itself names the same corpus
    assert read_corpus_index([corpus / "mixture_manifest.json"]) == index


def small_corpus(tmp_path):
    """Two sources of 8-token rows: a (4 shards: 10, 10, 10, 4 rows), b (3 shards of 8)."""
    return write_release_layout(tmp_path / "small", {"a": [10, 10, 10, 4], "b": [8, 8, 8]}, seq_len=8)


def scores_file(tmp_path, scores):
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(scores))
    return path


def test_quality_scores_take_the_best_shards_first_ties_by_file_name(tmp_path, capsys):
    corpus = small_corpus(tmp_path)
    scores = {score_key("a", "tokens-00000.bin"): 0.1, score_key("a", "tokens-00001.bin"): 0.9,
              score_key("a", "tokens-00002.bin"): 0.5, score_key("a", "tokens-00003.bin"): 0.9,
              score_key("b", "tokens-00000.bin"): 1, score_key("b", "tokens-00001.bin"): 2,
              score_key("b", "tokens-00002.bin"): 2, "corpora/unused/tokens-00000.bin": 5}
    out = tmp_path / "q.json"
    args = ["data", "plan", "--manifest", str(corpus), "--source-tokens", f"a={24 * 8}", f"b={12 * 8}",
            "--passes", "a=2", "--row-alignment", "4", "--dataset", "d", "--revision", "r", "--out", str(out),
            "--quality-scores", str(scores_file(tmp_path, scores))]
    assert main(args) == 0, capsys.readouterr().err
    doc = load_plan(out).doc
    assert doc["selection_mode"] == "quality_score"
    # a: 0.9 (00001 before 00003 by name), 0.9, then 0.5 partially; b: 2, 2 (by name) partially
    assert doc["phases"][0]["sources"] == {
        "a": [{"file": "tokens-00001.bin", "rows": 10}, {"file": "tokens-00003.bin", "rows": 4},
              {"file": "tokens-00002.bin", "rows": 10}],
        "b": [{"file": "tokens-00001.bin", "rows": 8}, {"file": "tokens-00002.bin", "rows": 4}]}
    assert doc["phases"][1] == {"name": "quality_replay_2", "passes": 1, "sources": {"a": doc["phases"][0]["sources"]["a"]}}
    assert doc["trained_tokens"] == (24 * 2 + 12) * 8
    # without scores: manifest order
    plain = build_plan(read_corpus_index([corpus]), None, dataset="d", revision="r", row_alignment=4,
                       source_budgets={"a": 24 * 8, "b": 12 * 8})
    assert plain["selection_mode"] == "manifest_order"
    assert [e["file"] for e in plain["phases"][0]["sources"]["a"]] == ["tokens-00000.bin", "tokens-00001.bin",
                                                                        "tokens-00002.bin"]


@pytest.mark.parametrize("scores, needle", [
    ({"corpora/a/tokens-00000.bin": 1.0}, "lack 3 of the 4 shards of source 'a' (first: corpora/a/tokens-00001.bin"),
    ({**{f"corpora/a/tokens-0000{i}.bin": 1 for i in range(4)}, "corpora/a/tokens-00009.bin": 1},
     "name 1 shard(s) of source 'a' that its manifest does not list (first: corpora/a/tokens-00009.bin)"),
    ({**{f"corpora/a/tokens-0000{i}.bin": 1 for i in range(3)}, "corpora/a/tokens-00003.bin": "high"},
     "quality score corpora/a/tokens-00003.bin is 'high'; every score must be a finite number"),
    ([1, 2], "JSON object"),
])
def test_a_score_file_that_cannot_order_a_selected_source_is_refused(tmp_path, capsys, scores, needle):
    corpus = small_corpus(tmp_path)
    out = tmp_path / "plans" / "q.json"
    args = ["data", "plan", "--manifest", str(corpus), "--source-tokens", f"a={16 * 8}", "--row-alignment", "4",
            "--dataset", "d", "--revision", "r", "--out", str(out), "--quality-scores", str(scores_file(tmp_path, scores))]
    before = tree_digest(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-trhash data plan: error: ") and needle in err, err
    assert tree_digest(tmp_path) == before and not out.exists()


@pytest.mark.parametrize("budgets, passes, alignment, needle", [
    ({"a": 31}, None, 4, "source 'a' gets 31 tokens, less than one aligned block of 4 rows x 8"),
    ({"a": 40 * 8}, None, 4, "source 'a' needs 40 rows but its shards hold 34"),
    ({"nope": 64}, None, 1, "per-source budgets name ['nope']; the corpus holds ['a', 'b']"),
    ({"a": 64}, {"b": 2}, 1, "passes given for 'b', which is not a selected source (['a'])"),
    ({"a": 64}, {"a": 0}, 1, "passes for 'a' must be an integer >= 1, got 0"),
])
def test_budget_and_pass_refusals_name_the_numbers(tmp_path, budgets, passes, alignment, needle):
    with pytest.raises(PlanError) as info:
        build_plan(read_corpus_index([small_corpus(tmp_path)]), None, dataset="d", revision="r",
                   source_budgets=budgets, source_passes=passes, row_alignment=alignment)
    assert needle in str(info.value)


def test_a_subset_of_the_sources_keeps_the_budget_order(tmp_path):
    doc = build_plan(read_corpus_index([small_corpus(tmp_path)]), None, dataset="d", revision="r",
                     source_budgets={"b": 8 * 8, "a": 4 * 8})
    assert list(doc["source_unique_tokens"]) == ["b", "a"] and list(doc["phases"][0]["sources"]) == ["b", "a"]
    assert doc["requested_unique_tokens"] == 12 * 8 and "vocab_size" not in doc  # the release's layout has none
