"""The plan-file validation layer: malformed plans and hostile names are one message naming the
plan file and the field; every released plan still loads."""

import json
from pathlib import Path

import pytest

from ds_trhash.data.plans.plan import load_plan
from ds_trhash.data.plans.schema import PlanError, check_plan_fields

RELEASED = Path(__file__).resolve().parent / "release_plans"


def _released():
    return json.loads((RELEASED / "tr_hash_70b_quality_replay.json").read_text())


def _core(doc):
    return doc["phases"][0]["sources"]


@pytest.mark.parametrize("change, field, needle", [
    (lambda d: _core(d)["dclm"][0].update(file="../../../victim.bin"), "phases[0].sources.dclm[0].file",
     "without a directory part"),
    (lambda d: _core(d)["dclm"][0].update(file="/etc/passwd"), "phases[0].sources.dclm[0].file", "absolute path"),
    (lambda d: _core(d).update({"../docs": _core(d).pop("dclm")}), "phases[0].sources", "'../docs'"),
    (lambda d: d["source_passes"].update({"../docs": 1}), "source_passes", "'../docs'"),
    (lambda d: _core(d)["dclm"][0].update(rows="sixteen"), "phases[0].sources.dclm[0].rows", "'sixteen'"),
    (lambda d: _core(d)["dclm"][0].update(rows=True), "phases[0].sources.dclm[0].rows", "a boolean"),
    (lambda d: _core(d)["dclm"][0].pop("rows"), "phases[0].sources.dclm[0].rows", "is missing"),
    (lambda d: _core(d).update(dclm="tokens-00000.bin"), "phases[0].sources.dclm", "non-empty list"),
    (lambda d: d.update(seq_len="1024"), "seq_len", "'1024' (a string)"),
    (lambda d: d.update(row_alignment=True), "row_alignment", "a boolean"),
    (lambda d: d.update(trained_tokens=1.5), "trained_tokens", "a number"),
    (lambda d: d.update(dataset=7), "dataset", "non-empty string"),
    (lambda d: d["source_unique_tokens"].update(dclm="many"), "source_unique_tokens.dclm", "'many'"),
    (lambda d: d["phases"][1].update(passes="2"), "phases[1].passes", "'2' (a string)"),
    (lambda d: d["phases"].append("replay"), "phases[3]", "must be a JSON object"),
    (lambda d: d.update(correction=[1]), "correction", "it must be an object"),
])
def test_malformed_and_hostile_plans_name_the_file_and_field(tmp_path, change, field, needle):
    doc = _released()
    change(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert f"replay plan {path} field {field!r}" in message and needle in message, message
    assert "ds-trhash data plan" in message


def test_unreadable_plan_files_say_what_and_where(tmp_path):
    with pytest.raises(PlanError, match="is a directory, not a plan file"):
        load_plan(tmp_path)
    (tmp_path / "latin1.json").write_bytes(b'{"format":\n "caf\xe9"}')
    with pytest.raises(PlanError, match="line 2 holds a non-UTF-8 byte"):
        load_plan(tmp_path / "latin1.json")
    (tmp_path / "cut.json").write_text('{"format": ')
    with pytest.raises(PlanError, match="line 1 column 12"):
        load_plan(tmp_path / "cut.json")
    with pytest.raises(PlanError, match="^plan is not a JSON object"):
        check_plan_fields([])


def test_every_released_plan_passes_the_field_checks():
    for path in sorted(RELEASED.glob("*.json")):
        check_plan_fields(json.loads(path.read_text()), str(path))
