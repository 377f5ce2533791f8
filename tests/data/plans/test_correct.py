"""The corrective plan (docs/contracts.md §2c): `ds-trhash data correct-plan` with the release's counts
rebuilds the released corrected plan byte for byte from the uncorrected one and the corpus's
manifests; each refusal names the numbers and writes nothing."""
import json

import pytest

from ds_trhash.cli import main
from ds_trhash.data.plans.corpus_index import read_corpus_index
from ds_trhash.data.plans.plan import load_plan, source_rows
from ds_trhash.data.plans.correct import build_corrective_plan
from tests.data.release_corpus import (
    BUDGETS, CORRECTED, DOUBLE_EXPOSED, FULL_ROWS, RELEASED, REPLAY, write_release_corpus, write_release_layout,
)
from tests.fail_closed import ds_trhash, tree_digest

CORRECTED_FINGERPRINT = "44bc8ef475bcd3af5cc593903a8bb24b21c0425ff2b4adf30543c88b5bd1be0a"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_release_corpus(tmp_path_factory.mktemp("release") / "corpus")


def counts(values):
    return [f"{source}={n}" for source, n in values.items()]


def test_correct_plan_rebuilds_the_released_corrected_plan(corpus, tmp_path, capsys):
    out = tmp_path / "corrected.json"
    assert main(["data", "correct-plan", str(RELEASED / REPLAY), "--double-exposed", *counts(DOUBLE_EXPOSED),
                 "--manifest", str(corpus), "--out", str(out)]) == 0
    assert f"fingerprint {CORRECTED_FINGERPRINT}" in capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads((RELEASED / CORRECTED).read_text())
    assert out.read_bytes() == (RELEASED / CORRECTED).read_bytes()
    fixed, original = load_plan(out), load_plan(RELEASED / REPLAY)
    assert fixed.phases[0] == original.phases[0]  # phase one bit for bit
    assert [source_rows(p["sources"]) for p in fixed.phases] == [source_rows(p["sources"]) for p in original.phases]
    assert fixed.trained_tokens == original.trained_tokens
    # the backfill: as many new rows as the 9 + 3 + 1 + 1 + 2 (full) shards swapped out
    assert fixed.unique_tokens - original.unique_tokens == 16 * FULL_ROWS * 1024


def test_sources_not_named_keep_their_selection_and_zero_changes_nothing_but_the_names(corpus):
    plan = load_plan(RELEASED / REPLAY)
    doc = build_corrective_plan(plan, {"cosmopedia_v2": 2}, read_corpus_index([corpus]))
    assert doc["correction"]["already_double_exposed_shards"] == {"cosmopedia_v2": 2}
    replay2 = doc["phases"][1]
    assert replay2["name"] == "quality_replay_2_corrected"
    assert replay2["sources"]["stack_edu"] == plan.phases[1]["sources"]["stack_edu"]
    core = plan.phases[0]["sources"]["cosmopedia_v2"]
    assert replay2["sources"]["cosmopedia_v2"] == core[2:] + [{"file": "tokens-00007.bin", "rows": FULL_ROWS},
                                                              {"file": "tokens-00008.bin", "rows": FULL_ROWS}]
    same = build_corrective_plan(plan, {"dclm": 0}, read_corpus_index([corpus]))
    assert [p["sources"] for p in same["phases"]] == [p["sources"] for p in plan.phases]
    assert same["unique_tokens"] == plan.unique_tokens


def test_refusals_name_the_numbers_and_write_nothing(corpus, tmp_path, capsys):
    short = write_release_layout(tmp_path / "short", {s: [FULL_ROWS] * n for s, n in
                                                      {**{s: 30 for s in BUDGETS}, "fineweb_edu_dedup": 27}.items()})
    plans = tmp_path / "plans"
    plans.mkdir()
    (plans / REPLAY).write_bytes((RELEASED / REPLAY).read_bytes())
    (plans / "taken.json").write_text("{}")
    cases = [
        (["nope=1"], corpus, "--double-exposed names ['nope'], not a source of the plan (its sources: ['dclm', "),
        (["finemath=6"], corpus, "--double-exposed finemath=6: the unique core holds only 5 shard(s) of 'finemath'"),
        (["fineweb_edu_dedup=9"], short,
         "replacing those shards needs 8789058 rows, but the 2 shard(s) of 'fineweb_edu_dedup' the unique core does "
         "not use hold 1953124: 6835934 rows short"),
        (["finemath=x"], corpus, "--double-exposed 'finemath=x'"),
    ]
    # an already corrected plan is refused; an existing different file at --out is never replaced
    cases += [(["finemath=1"], corpus, "already a corrected plan", RELEASED / CORRECTED),
              (["finemath=1"], corpus, "refusing to overwrite", plans / REPLAY, plans / "taken.json")]
    before = tree_digest(tmp_path)
    for given, manifest, needle, *paths in cases:
        plan, out = (paths + [plans / REPLAY, plans / "new.json"][len(paths):])[:2]
        code = main(["data", "correct-plan", str(plan), "--double-exposed", *given, "--manifest", str(manifest),
                     "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("ds-trhash data correct-plan: error: "), err
        assert needle in err, err
        assert tree_digest(tmp_path) == before
    # through the installed command: exit 2, one line, no traceback
    proc = ds_trhash("data", "correct-plan", plans / REPLAY, "--double-exposed", "finemath=6", "--manifest", corpus,
                     "--out", plans / "new.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert "holds only 5 shard(s) of 'finemath'" in proc.stderr and tree_digest(tmp_path) == before
