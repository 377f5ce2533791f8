"""The corrective replay plan (docs/contracts.md §2c): the same unique core, and replay phases that
swap shards already trained twice for shards the plan never used.

A run that already saw the first B unique-core shards of a source twice (say, in an earlier,
interrupted attempt) should not see them a third time. The corrected plan keeps phase one bit for
bit (so checkpoints of the unique core stay valid and its fingerprint is unchanged), drops those B
shards from every later phase of that source, and refills the same number of rows from the
source's shards that the unique core does not touch, in manifest order. Every phase keeps its row
count, so ``trained_tokens`` and the step count are unchanged; ``unique_tokens`` grows by the new rows.
"""
from __future__ import annotations

from typing import Mapping

from ds_trhash.data.plans.corpus_index import CorpusIndex
from ds_trhash.data.plans.plan import UNIQUE_CORE, PlanError, distinct_rows, plan_doc, source_rows, validate_plan_doc, PlanLike
from ds_trhash.data.plans.build import plan_document, replay_phases, select_rows

CORRECTED_PHASE = "quality_replay_{n}_corrected"
# The released corrected plan's own wording of what it is (a value of the plan, kept so that
# the rebuild matches the released file exactly).
CORRECTION_NOTE = (
    "phase 1 unchanged; later replay phases swap already-double-exposed shards for previously-unused ones from "
    "the same source, same row counts per phase. trained_tokens (total rows trained on) is unchanged from the "
    "uncorrected plan; unique_tokens is larger, since the backfill shards are genuinely new distinct material the "
    "uncorrected plan never touched at all"
)


def _check_against_corpus(core: Mapping[str, list], corpus: CorpusIndex, seq_len: int) -> None:
    """The plan's unique core must be a selection of this corpus: same seq_len, every file listed
    with at least the rows the plan takes."""
    if corpus.seq_len != seq_len:
        raise PlanError(f"the plan has seq_len {seq_len}, the corpus {corpus.seq_len}; give the corpus the plan was built from")
    for source, entries in core.items():
        if source not in corpus.sources:
            raise PlanError(f"the plan's source {source!r} is not in the corpus (it holds {list(corpus.sources)})")
        rows = {shard.file: shard.rows for shard in corpus.sources[source]}
        for entry in entries:
            if rows.get(entry["file"], 0) < entry["rows"]:
                raise PlanError(f"the plan takes {entry['rows']} rows of {source}/{entry['file']}, which the corpus "
                                f"lists with {rows.get(entry['file'], 'no')} rows; give the corpus the plan was built from")


def _corrected_selection(source: str, core: list[dict], count: int, corpus: CorpusIndex) -> list[dict]:
    if count > len(core):
        raise PlanError(f"--double-exposed {source}={count}: the unique core holds only {len(core)} shard(s) of "
                        f"{source!r}; at most {len(core)} can have been trained twice")
    dropped = sum(entry["rows"] for entry in core[:count])
    used = {entry["file"] for entry in core}
    unused = [shard for shard in corpus.sources[source] if shard.file not in used]
    backfill = select_rows(unused, dropped)
    short = dropped - sum(entry["rows"] for entry in backfill)
    if short:
        raise PlanError(f"--double-exposed {source}={count}: replacing those shards needs {dropped} rows, but the "
                        f"{len(unused)} shard(s) of {source!r} the unique core does not use hold "
                        f"{dropped - short}: {short} rows short")
    return [dict(entry) for entry in core[count:]] + backfill


def build_corrective_plan(plan: PlanLike, double_exposed: Mapping[str, int], corpus: CorpusIndex) -> dict:
    """The corrected plan of an uncorrected ``plan`` given, per source, how many of its first
    unique-core shards were already trained twice (sources not named: none)."""
    doc = plan_doc(plan)
    validate_plan_doc(doc)
    if "correction" in doc:
        raise PlanError("this plan is already a corrected plan; correct the plan it was made from")
    core = doc["phases"][0]["sources"]
    passes = dict(doc["source_passes"])
    for phase in doc["phases"][1:]:
        for source, entries in phase["sources"].items():
            if entries != core.get(source):
                raise PlanError(f"phase {phase['name']!r} does not repeat the unique core's {source!r} rows; only a plan "
                                "whose replay phases repeat its unique core can be corrected")
    unknown = [source for source in double_exposed if source not in core]
    if unknown:
        raise PlanError(f"--double-exposed names {unknown}, not a source of the plan (its sources: {list(core)})")
    for source, count in double_exposed.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise PlanError(f"--double-exposed {source}={count!r}: the count must be an integer >= 0")
    _check_against_corpus(core, corpus, doc["seq_len"])
    selections = {
        source: (_corrected_selection(source, entries, double_exposed[source], corpus)
                 if double_exposed.get(source, 0) > 0 and passes[source] >= 2 else [dict(e) for e in entries])
        for source, entries in core.items()
    }
    phases = [{"name": UNIQUE_CORE, "passes": 1, "sources": core},
              *replay_phases(selections, passes, CORRECTED_PHASE)]
    for before, after in zip(doc["phases"][1:], phases[1:]):
        assert source_rows(before["sources"]) == source_rows(after["sources"]), "a corrected phase changed its rows"
    extra = {key: doc[key] for key in ("vocab_size", "tokenizer_sha256") if key in doc}
    return plan_document(
        seq_len=doc["seq_len"], selection_mode=doc["selection_mode"], row_alignment=doc["row_alignment"],
        requested_unique_tokens=doc["requested_unique_tokens"], unique_tokens=distinct_rows(phases) * doc["seq_len"],
        source_unique_tokens=doc["source_unique_tokens"], source_passes=passes, phases=phases,
        dataset=doc["dataset"], revision=doc["revision"],
        correction={"already_double_exposed_shards": dict(double_exposed), "note": CORRECTION_NOTE}, identity=extra)
