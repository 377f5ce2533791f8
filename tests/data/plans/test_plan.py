import copy
import hashlib
import json

import pytest

from ds_trhash.data.plans.plan import (
    PLAN_FORMAT,
    PlanError,
    check_plan_unchanged,
    derive_refinement,
    load_plan,
    unique_core_fingerprint,
    validate_refinement,
    write_plan,
)
from ds_trhash.data.plans.build import build_plan

L = 16


def manifest(source, shard_rows, seq_len=L, tokenizer="tok"):
    return {
        "format": "tr-hash-token-shards-v1",
        "source": source,
        "seq_len": seq_len,
        "vocab_size": 1000,
        "tokenizer_sha256": tokenizer,
        "shards": [
            {"file": f"shard-{i:05d}.bin", "rows": rows, "tokens": rows * seq_len + 1, "sha256": f"{source}{i}"}
            for i, rows in enumerate(shard_rows)
        ],
    }


MANIFESTS = {"web": manifest("web", [10, 10, 10, 5]), "code": manifest("code", [8, 8, 8])}


def plan(**overrides):
    options = dict(dataset="demo", revision="r1", row_alignment=4, source_passes={"web": 2, "code": 3})
    options.update(overrides)
    budget = options.pop("budget", 40 * L)
    return build_plan(MANIFESTS, budget, **options)


def reorder(value):
    """The same JSON value with every object's keys in reverse order."""
    if isinstance(value, dict):
        return {key: reorder(value[key]) for key in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(item) for item in value]
    return value


def test_budgets_are_split_by_weight_aligned_down_and_taken_in_shard_order():
    doc = plan(source_weights={"web": 3, "code": 1}, budget=40 * L)
    # web: 30 rows budget -> 28 aligned; code: 10 rows -> 8 aligned.
    core = doc["phases"][0]
    assert core["name"] == "unique_core" and core["passes"] == 1
    assert core["sources"]["web"] == [{"file": "shard-00000.bin", "rows": 10}, {"file": "shard-00001.bin", "rows": 10},
                                      {"file": "shard-00002.bin", "rows": 8}]
    assert core["sources"]["code"] == [{"file": "shard-00000.bin", "rows": 8}]
    assert doc["source_unique_tokens"] == {"web": 28 * L, "code": 8 * L}
    assert doc["requested_unique_tokens"] == 40 * L and doc["unique_tokens"] == 36 * L
    assert doc["format"] == PLAN_FORMAT and doc["seq_len"] == L and doc["row_alignment"] == 4


def test_default_weights_follow_available_tokens_and_per_source_budgets_work():
    doc = plan(budget=59 * L, source_passes=None)  # available 35 + 24 rows: takes everything
    assert doc["source_unique_tokens"] == {"web": 32 * L, "code": 24 * L}
    assert doc["phases"][0]["sources"]["web"][-1] == {"file": "shard-00003.bin", "rows": 2}
    doc = plan(budget=None, source_budgets={"web": 13 * L, "code": 9 * L})
    assert doc["source_unique_tokens"] == {"web": 12 * L, "code": 8 * L}
    assert doc["requested_unique_tokens"] == 22 * L


def test_replay_phases_repeat_core_rows_and_trained_tokens_count_passes():
    doc = plan(source_weights={"web": 1, "code": 1}, budget=32 * L)
    names = [p["name"] for p in doc["phases"]]
    assert names == ["unique_core", "quality_replay_2", "quality_replay_3"]
    core = doc["phases"][0]["sources"]
    assert doc["phases"][1]["sources"] == core
    assert doc["phases"][2]["sources"] == {"code": core["code"]}
    assert doc["source_passes"] == {"web": 2, "code": 3}
    assert doc["trained_tokens"] == (16 * 2 + 16 * 3) * L
    assert doc["trained_tokens"] == sum(
        p["passes"] * L * sum(e["rows"] for es in p["sources"].values() for e in es) for p in doc["phases"]
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"budget": 200 * L}, "needs .* rows but its shards hold"),
        ({"budget": 5 * L, "source_weights": {"web": 1, "code": 1}}, "less than one aligned block"),
        ({"source_passes": {"nope": 2}}, "not a selected source"),
        ({"source_passes": {"web": 0}}, "integer >= 1"),
        ({"source_weights": {"web": 1}}, "must name exactly the sources"),
        ({"seq_len": 32}, "disagree on seq_len"),
        ({"source_budgets": {"web": 16 * L, "nope": 8 * L}, "budget": None}, r"name \['nope'\]; the corpus holds"),
        ({"source_budgets": {"web": 16 * L, "code": 8 * L}}, "!= the per-source budgets' sum"),
    ],
)
def test_build_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):  # PlanError, or CorpusIndexError for the manifests
        plan(**overrides)


def test_manifests_with_different_tokenizers_are_refused():
    mixed = {"web": MANIFESTS["web"], "code": manifest("code", [8], tokenizer="other")}
    with pytest.raises(ValueError, match="disagree on tokenizer_sha256"):
        build_plan(mixed, 16 * L, dataset="d", revision="r")


def test_fingerprint_follows_the_spec_and_ignores_key_order():
    doc = plan()
    keys = ("format", "dataset", "revision", "seq_len", "selection_mode", "row_alignment", "unique_tokens",
            "source_unique_tokens")
    identity = {key: doc[key] for key in keys}
    identity["sources"] = doc["phases"][0]["sources"]  # the key the released plans use
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    assert unique_core_fingerprint(doc) == hashlib.sha256(canonical).hexdigest()
    assert unique_core_fingerprint(reorder(doc)) == unique_core_fingerprint(doc)
    # Replay phases, passes and requested tokens are not part of the unique core.
    assert unique_core_fingerprint(plan(source_passes=None)) == unique_core_fingerprint(doc)


def test_fingerprint_changes_when_one_row_moves_with_totals_equal():
    doc = plan(source_weights={"web": 3, "code": 1})
    moved = copy.deepcopy(doc)
    web = moved["phases"][0]["sources"]["web"]
    web[1]["rows"] -= 1
    web[2]["rows"] += 1
    assert moved["unique_tokens"] == doc["unique_tokens"]
    assert unique_core_fingerprint(moved) != unique_core_fingerprint(doc)
    renamed = copy.deepcopy(doc)
    renamed["phases"][0]["sources"]["code"][0]["file"] = "shard-00001.bin"
    assert unique_core_fingerprint(renamed) != unique_core_fingerprint(doc)


def test_refinement_derivation_keeps_the_core_once():
    pre = plan()
    ref = derive_refinement(pre)
    assert [p["name"] for p in ref["phases"]] == ["unique_core"] and ref["phases"][0]["passes"] == 1
    assert ref["trained_tokens"] == ref["unique_tokens"] == pre["unique_tokens"]
    assert set(ref["source_passes"].values()) == {1}
    assert unique_core_fingerprint(ref) == unique_core_fingerprint(pre)
    validate_refinement(ref, pre)
    assert len(pre["phases"]) == 3, "derivation must not modify the pretraining plan"


def _broken(mutate):
    ref = derive_refinement(plan())
    mutate(ref)
    return ref


@pytest.mark.parametrize(
    "mutate, rule",
    [
        (lambda r: r["phases"].append(copy.deepcopy(r["phases"][0]) | {"name": "replay_1"}), "one_phase"),
        (lambda r: r["phases"][0].update(name="core"), "phase_name"),
        (lambda r: r["phases"][0].update(passes=2), "phase_passes"),
        (lambda r: r.update(trained_tokens=r["trained_tokens"] + L), "trained_equals_unique"),
        (lambda r: r["source_passes"].update(web=2), "source_passes"),
        (lambda r: r["phases"][0]["sources"]["code"][0].update(file="shard-00002.bin"), "fingerprint"),
        (lambda r: r.update(revision="r2"), "fingerprint"),
    ],
)
def test_every_refinement_rule_is_enforced(mutate, rule):
    pre = plan()
    with pytest.raises(PlanError) as info:
        validate_refinement(_broken(mutate), pre)
    assert info.value.rule == rule


def test_write_once_then_load(tmp_path):
    doc = plan()
    written = write_plan(doc, tmp_path / "plans" / "pre.json")
    raw = (tmp_path / "plans" / "pre.json").read_bytes()
    assert written.sha256 == hashlib.sha256(raw).hexdigest()
    loaded = load_plan(tmp_path / "plans" / "pre.json")
    assert loaded.doc == doc and loaded.fingerprint == unique_core_fingerprint(doc)
    assert (loaded.seq_len, loaded.trained_tokens, loaded.unique_tokens) == (L, doc["trained_tokens"], doc["unique_tokens"])
    assert write_plan(doc, tmp_path / "plans" / "pre.json").sha256 == loaded.sha256  # same bytes: no-op
    with pytest.raises(PlanError, match="refusing to overwrite"):
        write_plan(derive_refinement(doc), tmp_path / "plans" / "pre.json")
    assert (tmp_path / "plans" / "pre.json").read_bytes() == raw
    assert sorted(p.name for p in (tmp_path / "plans").iterdir()) == ["pre.json"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="v0"), "field 'format' is 'v0'"),
        (lambda d: d.pop("revision"), "lacks required keys revision"),
        (lambda d: d.update(trained_tokens=1), "trained_tokens 1 !="),
        (lambda d: d.update(unique_tokens=1), "unique_tokens 1 !="),
        (lambda d: d["phases"].reverse(), "phase one is 'quality_replay_3'"),
        (lambda d: d["phases"][0]["sources"]["web"][0].update(rows=0), r"'phases\[0\].sources.web\[0\].rows' is 0"),
        (lambda d: d["phases"][1].update(passes=0), r"'phases\[1\].passes' is 0; it must be >= 1"),
        (lambda d: d.update(source_passes=[2, 3]), "field 'source_passes' is a list; it must be an object"),
        (lambda d: d.update(phases={}), "field 'phases' is an object; it must be a list"),
    ],
)
def test_load_rejects_malformed_plans(tmp_path, mutate, message):
    doc = plan()
    mutate(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        load_plan(tmp_path / "p.json")


def test_load_explains_missing_and_invalid_files(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="not valid UTF-8 JSON"):
        load_plan(tmp_path / "bad.json")


def test_check_plan_unchanged(tmp_path):
    path = tmp_path / "p.json"
    loaded = write_plan(plan(), path)
    check_plan_unchanged(loaded, loaded.sha256)
    check_plan_unchanged(path, loaded.sha256)
    path.write_text(path.read_text().replace('"r1"', '"r2"'))
    with pytest.raises(PlanError, match="plan file changed since the checkpoint recorded it"):
        check_plan_unchanged(loaded, loaded.sha256)
    path.unlink()
    with pytest.raises(PlanError, match="<missing>"):
        check_plan_unchanged(loaded, loaded.sha256)
