"""The validation layer of replay-plan files: types, fields and names (docs/contracts.md §2).

``check_plan_fields`` runs where a plan is read, before any total is summed or any shard path is
built: every required key present with its JSON type, every phase an object with a name, a pass
count and sources, every source name and shard ``file`` a bare name (``ds_trhash.safe_names``:
a plan from the Hub must not name ``../../../victim.bin`` or a source ``../docs``), every row
count a positive integer (not a string, not a boolean). Each error names the plan file, the
dotted field and the fix. The consistency of the totals is ``plan.validate_plan_doc``'s.
"""
from __future__ import annotations

from collections.abc import Mapping

from ds_trhash.errors import UserError

from ds_trhash.data.formats.json_fields import JsonFields

PLAN_FORMAT = "tr-hash-token-replay-plan-v1"
REQUIRED_KEYS = (
    "format",
    "seq_len",
    "selection_mode",
    "row_alignment",
    "requested_unique_tokens",
    "unique_tokens",
    "trained_tokens",
    "source_unique_tokens",
    "source_passes",
    "dataset",
    "revision",
    "phases",
)
FIX = "rebuild it with `ds-trhash data plan` or restore the original plan file"


class PlanError(UserError, ValueError):
    """A plan is malformed, inconsistent, changed, or breaks a refinement rule (``rule``)."""

    def __init__(self, message: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule


class _Fields(JsonFields):
    error, fix = PlanError, FIX


def _source_numbers(r: _Fields, key: str, minimum: int) -> None:
    table = r.table(key)
    for source, value in table.items():
        r.check_name(f"{key}", source)
        r.check_integer(f"{key}.{source}", value, minimum)


def _check_phase(phase: object, where: str, index: int) -> None:
    r = _Fields(phase, where, f"phases[{index}]")
    r.text("name")
    r.integer("passes", minimum=1)
    sources = r.table("sources")
    if not sources:
        raise r.fail("sources", "is empty; a phase reads at least one source")
    for source, entries in sources.items():
        r.check_name("sources", source)
        if not isinstance(entries, list) or not entries:
            raise r.fail(f"sources.{source}", "must be a non-empty list of {\"file\": name, \"rows\": positive int}")
        for k, entry in enumerate(entries):
            e = _Fields(entry, where, f"phases[{index}].sources.{source}[{k}]")
            e.name("file")
            e.integer("rows", minimum=1)


def check_plan_fields(doc: object, where: str = "plan") -> None:
    """Raise PlanError unless ``doc`` has the plan format's keys, types and safe names."""
    if not isinstance(doc, Mapping):
        raise PlanError(f"{where} is not a JSON object; {FIX}")
    r = _Fields(doc, where)
    if doc.get("format") != PLAN_FORMAT:
        raise r.fail("format", f"is {doc.get('format')!r}, expected {PLAN_FORMAT!r}")
    missing = [key for key in REQUIRED_KEYS if key not in doc]
    if missing:
        raise PlanError(f"{where} lacks required keys {', '.join(missing)}; {FIX}")
    r.integer("seq_len", minimum=1)
    r.integer("row_alignment", minimum=1)
    for key in ("requested_unique_tokens", "unique_tokens", "trained_tokens"):
        r.integer(key)
    for key in ("selection_mode", "dataset", "revision"):
        r.text(key)
    _source_numbers(r, "source_unique_tokens", 0)
    _source_numbers(r, "source_passes", 1)
    phases = r.array("phases")
    if not phases:
        raise r.fail("phases", "is empty; phase one must be 'unique_core'")
    for index, phase in enumerate(phases):
        _check_phase(phase, where, index)
    r.table("correction", required=False)
    r.integer("vocab_size", minimum=1, required=False)  # null: the corpus records none
    r.text("tokenizer_sha256", required=False)
