"""Replay plans (docs/contracts.md §2): write once, load, fingerprint, derive and check refinement
(building one from manifests: ``plan_build``; correcting one: ``plan_correct``).

A plan is the immutable statement of which rows a run trains on and how often. Refinement
is only meaningful on the same corpus, so the unique core gets a fingerprint over its exact
shard/row selection: equal token totals are never taken as equal data.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

from ds_trhash.io import json_text, sha256_file

from ds_trhash.data.plans.schema import PLAN_FORMAT, REQUIRED_KEYS, PlanError, check_plan_fields  # noqa: F401 (re-exported)
from ds_trhash.data.formats.tokenizer import PathLike

UNIQUE_CORE = "unique_core"
FINGERPRINT_KEYS = (
    "format",
    "dataset",
    "revision",
    "seq_len",
    "selection_mode",
    "row_alignment",
    "unique_tokens",
    "source_unique_tokens",
)
# Key under which the unique_core phase's sources enter the fingerprinted document. It is
# `sources`, as in the released plans: any other name gives fingerprints that match none of them.
FINGERPRINT_SOURCES_KEY = "sources"


@dataclass(frozen=True)
class ReplayPlan:
    doc: dict
    path: Optional[Path]
    sha256: str
    fingerprint: str
    seq_len: int
    trained_tokens: int
    unique_tokens: int

    @property
    def phases(self) -> list[dict]:
        return self.doc["phases"]


PlanLike = Union[ReplayPlan, Mapping]


def plan_doc(plan: PlanLike) -> Mapping:
    return plan.doc if isinstance(plan, ReplayPlan) else plan


def canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")


def source_rows(sources: Mapping[str, list]) -> dict[str, int]:
    """Rows per source of one phase's ``sources`` mapping."""
    return {source: sum(int(entry["rows"]) for entry in entries) for source, entries in sources.items()}


def distinct_rows(phases: list) -> int:
    """Rows a plan holds at least once over all its phases.

    Rows are taken from the front of each shard, so two phases naming the same shard share the
    shorter prefix; a replay phase that uses shards the unique core never touched (a corrected
    plan) adds them. This is what ``unique_tokens`` counts (times ``seq_len``)."""
    longest: dict[tuple[str, str], int] = {}
    for phase in phases:
        for source, entries in phase["sources"].items():
            for entry in entries:
                key = (source, entry["file"])
                longest[key] = max(longest.get(key, 0), int(entry["rows"]))
    return sum(longest.values())


def _unique_core(doc: Mapping) -> dict:
    phases = doc.get("phases")
    if not isinstance(phases, list) or not phases:
        raise PlanError("plan has no phases; phase one must be 'unique_core'")
    first = phases[0]
    if not isinstance(first, dict) or first.get("name") != UNIQUE_CORE:
        raise PlanError(f"plan phase one is {first.get('name') if isinstance(first, dict) else first!r}, must be {UNIQUE_CORE!r}")
    return first


def unique_core_fingerprint(doc: PlanLike) -> str:
    """SHA-256 of the canonical JSON of the unique core's identity (docs/contracts.md §2)."""
    doc = plan_doc(doc)
    missing = [key for key in FINGERPRINT_KEYS if key not in doc]
    if missing:
        raise PlanError(f"plan lacks {', '.join(missing)}; cannot fingerprint its unique core")
    core = {key: doc[key] for key in FINGERPRINT_KEYS}
    core[FINGERPRINT_SOURCES_KEY] = _unique_core(doc).get("sources")
    return hashlib.sha256(canonical_json(core)).hexdigest()


def validate_plan_doc(doc: Mapping, where: str = "plan") -> None:
    """Check the fields (``plan_schema.check_plan_fields``: types, names) and that every total
    agrees with the listed rows."""
    check_plan_fields(doc, where)
    seq_len, alignment = doc["seq_len"], doc["row_alignment"]
    core = _unique_core(doc)
    if core["passes"] != 1:
        raise PlanError(f"{where}: phase {UNIQUE_CORE!r} has passes {core['passes']}, must be 1")
    core_rows = source_rows(core["sources"])
    for source, rows in core_rows.items():
        if rows % alignment:
            raise PlanError(f"{where}: source {source!r} has {rows} unique rows, not a multiple of row_alignment {alignment}")
    expected_sources = {source: rows * seq_len for source, rows in core_rows.items()}
    if dict(doc["source_unique_tokens"]) != expected_sources:
        raise PlanError(f"{where}: source_unique_tokens {doc['source_unique_tokens']} disagree with the unique core rows ({expected_sources})")
    distinct = distinct_rows(doc["phases"]) * seq_len
    if doc["unique_tokens"] != distinct:
        raise PlanError(f"{where}: unique_tokens {doc['unique_tokens']} != {distinct} distinct tokens over all phases "
                        f"(the unique core holds {sum(expected_sources.values())})")
    if "correction" in doc and not isinstance(doc["correction"], Mapping):
        raise PlanError(f"{where}: correction must be an object describing the correction, got {doc['correction']!r}")
    trained = sum(sum(source_rows(p["sources"]).values()) * seq_len * p["passes"] for p in doc["phases"])
    if doc["trained_tokens"] != trained:
        raise PlanError(f"{where}: trained_tokens {doc['trained_tokens']} != {trained} summed over phases (rows·seq_len·passes)")


def derive_refinement(doc: PlanLike) -> dict:
    """The refinement plan of a pretraining plan: its unique core once, nothing replayed.

    A plan whose replay phases hold rows outside the unique core (a corrected plan) counts
    them in ``unique_tokens``, which its fingerprint covers; a one-pass plan over the core alone
    cannot carry that fingerprint, so no refinement can be derived and we say so."""
    doc = plan_doc(doc)
    validate_plan_doc(doc)
    core = copy.deepcopy(_unique_core(doc))
    core_tokens = distinct_rows([core]) * int(doc["seq_len"])
    if core_tokens != doc["unique_tokens"]:
        raise PlanError(
            f"this plan's replay phases hold rows outside its unique core (unique_tokens {doc['unique_tokens']} > "
            f"{core_tokens} in the core), and its fingerprint covers them; a refinement trains the core once, "
            "so none can carry that fingerprint. Refine from a plan whose replays repeat the core")
    refined = copy.deepcopy(dict(doc))
    refined["phases"] = [core]
    refined["trained_tokens"] = refined["unique_tokens"]
    refined["source_passes"] = {source: 1 for source in core["sources"]}
    return refined


@dataclass(frozen=True)
class RuleResult:
    rule: str
    ok: bool
    detail: str


DERIVE = "derive the refinement plan from the pretraining plan with `ds-trhash data plan --refinement-of PRE.json --out REF.json`"


def _core_differences(ref_doc: Mapping, pre_doc: Mapping) -> str:
    """What differs between two unique cores, by field: a name or revision apart from the corpus."""
    fields = [f"{key} {ref_doc.get(key)!r} vs {pre_doc.get(key)!r}" for key in FINGERPRINT_KEYS
              if ref_doc.get(key) != pre_doc.get(key)]
    try:
        if _unique_core(ref_doc).get("sources") != _unique_core(pre_doc).get("sources"):
            fields.append("the unique core's sources (a changed shard or row count, even when totals match)")
    except PlanError:
        pass
    return "; ".join(fields) or "their canonical form"


def _refinement_rules(ref_doc: Mapping, pre_doc: Mapping) -> list[RuleResult]:
    phases = ref_doc["phases"] if isinstance(ref_doc.get("phases"), list) else []
    phase = phases[0] if phases and isinstance(phases[0], Mapping) else {}
    trained, unique = ref_doc.get("trained_tokens"), ref_doc.get("unique_tokens")
    replayed = {s: p for s, p in (ref_doc.get("source_passes") or {}).items() if p != 1}
    try:
        ref_fp, pre_fp = unique_core_fingerprint(ref_doc), unique_core_fingerprint(pre_doc)
        same = ref_fp == pre_fp
        fp_detail = (f"unique core fingerprint {ref_fp} == the pretraining plan's" if same else
                     f"refinement unique core fingerprint {ref_fp} != pretraining plan's {pre_fp}: the plans differ in "
                     f"{_core_differences(ref_doc, pre_doc)}; {DERIVE}")
    except PlanError as exc:
        same, fp_detail = False, str(exc)
    # a pretraining plan given as the refinement's fails the shape rules first: say how to make one
    shape = "" if len(phases) == 1 and not replayed else f"; {DERIVE}"
    return [
        RuleResult("one_phase", len(phases) == 1,
                   f"refinement plan has {len(phases)} phase(s), must have exactly one{shape}"),
        RuleResult("phase_name", phase.get("name") == UNIQUE_CORE,
                   f"refinement phase is named {phase.get('name')!r}, must be {UNIQUE_CORE!r}"),
        RuleResult("phase_passes", phase.get("passes") == 1,
                   f"refinement phase has passes {phase.get('passes')!r}, must be 1{shape}"),
        RuleResult("trained_equals_unique", trained == unique,
                   f"refinement trained_tokens {trained} {'==' if trained == unique else '!='} unique_tokens {unique}"
                   f"{shape}"),
        RuleResult("source_passes", not replayed,
                   "every source passes once" if not replayed else f"refinement source_passes must all be 1, got {replayed}"
                   f"{shape}"),
        RuleResult("fingerprint", same, fp_detail),
    ]


def check_refinement(ref: PlanLike, pre: PlanLike) -> list[RuleResult]:
    """Every refinement rule's result, in order; the launch refuses on the first that fails."""
    return _refinement_rules(plan_doc(ref), plan_doc(pre))


def validate_refinement(ref: PlanLike, pre: PlanLike) -> None:
    """Raise PlanError (with ``rule``) unless ``ref`` is a valid refinement of ``pre``."""
    for result in check_refinement(ref, pre):
        if not result.ok:
            raise PlanError(result.detail, rule=result.rule)


def load_plan(path: PathLike) -> ReplayPlan:
    path = Path(path)
    if path.is_dir():
        raise PlanError(f"replay plan {path} is a directory, not a plan file; point at the plan's .json file")
    if not path.is_file():
        raise PlanError(f"replay plan {path} does not exist; build one with `ds-trhash data plan`")
    raw = path.read_bytes()
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PlanError(f"replay plan {path} is not valid UTF-8 JSON: line {line} holds a non-UTF-8 byte "
                        f"(offset {exc.start}); restore the plan file") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"replay plan {path} is not valid UTF-8 JSON: line {exc.lineno} column {exc.colno}: "
                        f"{exc.msg}; restore the plan file") from None
    validate_plan_doc(doc, where=f"replay plan {path}")
    return ReplayPlan(
        doc=doc,
        path=path,
        sha256=hashlib.sha256(raw).hexdigest(),
        fingerprint=unique_core_fingerprint(doc),
        seq_len=doc["seq_len"],
        trained_tokens=doc["trained_tokens"],
        unique_tokens=doc["unique_tokens"],
    )


def write_plan(doc: Mapping, path: PathLike) -> ReplayPlan:
    """Write a plan once. The same bytes again is a no-op; different bytes are refused."""
    validate_plan_doc(doc)
    path = Path(path)
    data = json_text(doc).encode("utf-8")
    if path.exists():
        if path.read_bytes() != data:
            raise PlanError(f"refusing to overwrite {path}: plans are immutable; write the new plan to another path")
        return load_plan(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)  # fails if another writer got there first; never replaces
    except FileExistsError:
        if path.read_bytes() != data:
            raise PlanError(f"refusing to overwrite {path}: another plan was written there concurrently") from None
    finally:
        tmp.unlink()
    return load_plan(path)


def check_plan_unchanged(plan: Union[ReplayPlan, PathLike], recorded_sha256: str) -> None:
    """Compare the plan file on disk now with the hash a checkpoint recorded."""
    path = plan.path if isinstance(plan, ReplayPlan) else Path(plan)
    if path is None:
        raise PlanError("plan was not loaded from a file; cannot compare it with the checkpoint's record")
    current = sha256_file(path) if path.is_file() else "<missing>"
    if current != recorded_sha256:
        raise PlanError(
            f"plan file changed since the checkpoint recorded it: {path} has sha256 {current}, "
            f"the checkpoint recorded {recorded_sha256}; restore that plan or start a new stage"
        )
