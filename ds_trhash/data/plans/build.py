"""Building a replay plan from a corpus's manifests, by the release's rules (docs/contracts.md §2c).

Per source, a token budget becomes a row count (budget // seq_len, rounded down to a multiple of
``row_alignment``) taken from the front of the source's shards: in manifest order, or, given
quality scores, best-scored shard first. The unique core holds every source once; replay phase n
(n = 2 ... max passes) repeats the selections of the sources seen at least n times. With the
release's corpus and budgets this rebuilds the released plan byte for byte. Only the manifests are
read (``corpus_index``): no shard is opened, so a plan over 200B tokens builds in well under a second.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterable, Mapping, Optional, Union

from ds_trhash.data.plans.corpus_index import CorpusIndex, ShardRows, index_of_manifests
from ds_trhash.data.plans.plan import PLAN_FORMAT, UNIQUE_CORE, PlanError, source_rows, validate_plan_doc

MANIFEST_ORDER = "manifest_order"
QUALITY_SCORE = "quality_score"
REPLAY_PHASE = "quality_replay_{n}"

CorpusLike = Union[CorpusIndex, Mapping[str, Mapping]]


def score_key(source: str, file: str) -> str:
    """How a quality score file names a shard: its path in the release's corpus layout."""
    return f"corpora/{source}/{file}"


def _budgets(
    available: Mapping[str, int],
    requested: Optional[int],
    weights: Optional[Mapping[str, float]],
    budgets: Optional[Mapping[str, int]],
) -> tuple[int, dict[str, int]]:
    """Per-source token budgets (in the order given); default weights are the sources' available tokens."""
    if budgets is not None:
        if weights is not None:
            raise PlanError("give either source weights or per-source budgets, not both")
        unknown = [source for source in budgets if source not in available]
        if unknown or not budgets:
            raise PlanError(f"per-source budgets name {unknown or 'no source'}; the corpus holds {list(available)}")
        total = sum(int(value) for value in budgets.values())
        if requested is not None and requested != total:
            raise PlanError(f"unique token budget {requested} != the per-source budgets' sum {total}; drop one of them")
        return total, {source: int(value) for source, value in budgets.items()}
    if requested is None or requested < 1:
        raise PlanError(f"unique token budget must be a positive integer, got {requested!r}")
    weights = dict(available) if weights is None else dict(weights)
    if set(weights) != set(available):
        raise PlanError(f"source weights must name exactly the sources {sorted(available)}, got {sorted(weights)}")
    if any(value < 0 for value in weights.values()) or not any(value > 0 for value in weights.values()):
        raise PlanError(f"source weights {weights} must be >= 0 with at least one positive")
    weight_sum = sum((Fraction(value) for value in weights.values()), Fraction(0))
    return requested, {
        source: int(Fraction(requested) * Fraction(weights[source]) / weight_sum) for source in available if weights[source] > 0
    }


def _passes(budgets: Mapping[str, int], given: Optional[Mapping[str, int]]) -> dict[str, int]:
    passes = {source: 1 for source in budgets}
    for source, value in (given or {}).items():
        if source not in budgets:
            raise PlanError(f"passes given for {source!r}, which is not a selected source ({list(budgets)})")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"passes for {source!r} must be an integer >= 1, got {value!r}")
        passes[source] = value
    return passes


def check_quality_scores(corpus: CorpusIndex, sources: Iterable[str], scores: Mapping[str, object]) -> None:
    """Every shard of every selected source has a finite numeric score, and no score of a selected
    source names a shard its manifest does not list (a misspelt key would silently score nothing)."""
    for source in sources:
        known = {score_key(source, shard.file) for shard in corpus.sources[source]}
        missing = sorted(known - set(scores))
        if missing:
            raise PlanError(f"the quality scores lack {len(missing)} of the {len(known)} shards of source {source!r} "
                            f"(first: {', '.join(missing[:3])}); score every shard of a selected source")
        stray = sorted(key for key in scores if key.startswith(f"corpora/{source}/") and key not in known)
        if stray:
            raise PlanError(f"the quality scores name {len(stray)} shard(s) of source {source!r} that its manifest "
                            f"does not list (first: {', '.join(stray[:3])})")
        bad = [key for key in sorted(known) if not _finite_number(scores[key])]
        if bad:
            raise PlanError(f"quality score {bad[0]} is {scores[bad[0]]!r}; every score must be a finite number")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ordered(corpus: CorpusIndex, source: str, scores: Optional[Mapping[str, float]]) -> list[ShardRows]:
    shards = list(corpus.sources[source])
    if scores is None:
        return shards
    return sorted(shards, key=lambda shard: (-scores[score_key(source, shard.file)], shard.file))


def select_rows(shards: Iterable[ShardRows], rows: int) -> list[dict]:
    """Take ``rows`` rows from ``shards`` in order: each shard's min(its rows, what is left)."""
    entries, left = [], rows
    for shard in shards:
        if left == 0:
            break
        take = min(shard.rows, left)
        entries.append({"file": shard.file, "rows": take})
        left -= take
    return entries


def replay_phases(selections: Mapping[str, list], passes: Mapping[str, int], name: str = REPLAY_PHASE) -> list[dict]:
    """Phases n = 2 ... max(passes), each holding the selections of the sources with passes >= n
    (a phase with no source is left out)."""
    phases = []
    for n in range(2, max(passes.values(), default=1) + 1):
        sources = {source: [dict(e) for e in selections[source]] for source in selections if passes[source] >= n}
        if sources:
            phases.append({"name": name.format(n=n), "passes": 1, "sources": sources})
    return phases


def plan_document(*, seq_len: int, selection_mode: str, row_alignment: int, requested_unique_tokens: int,
                  unique_tokens: int, source_unique_tokens: Mapping[str, int], source_passes: Mapping[str, int],
                  phases: list[dict], dataset: str, revision: str, correction: Optional[Mapping] = None,
                  identity: Optional[Mapping] = None) -> dict:
    """A validated plan with its keys in the released files' order (so that ``write_plan`` of a
    rebuilt released plan gives its bytes); ``trained_tokens`` is counted from the phases."""
    trained = sum(sum(source_rows(p["sources"]).values()) * seq_len * p["passes"] for p in phases)
    doc = {"format": PLAN_FORMAT, "seq_len": seq_len, "selection_mode": selection_mode, "row_alignment": row_alignment,
           "requested_unique_tokens": requested_unique_tokens, "unique_tokens": unique_tokens, "trained_tokens": trained,
           "source_unique_tokens": dict(source_unique_tokens), "source_passes": dict(source_passes), "phases": phases}
    if correction is not None:
        doc["correction"] = dict(correction)
    doc.update(dataset=dataset, revision=revision, **(identity or {}))
    validate_plan_doc(doc)
    return doc


def build_plan(
    corpus: CorpusLike,
    unique_tokens_budget: Optional[int],
    *,
    dataset: str,
    revision: str,
    source_weights: Optional[Mapping[str, float]] = None,
    source_budgets: Optional[Mapping[str, int]] = None,
    source_passes: Optional[Mapping[str, int]] = None,
    row_alignment: int = 1,
    seq_len: Optional[int] = None,
    quality_scores: Optional[Mapping[str, float]] = None,
) -> dict:
    """A plan document over ``corpus`` (a CorpusIndex, or our shard manifests by source).

    Budgets come per source (``source_budgets``, in the order given) or as one total split by
    ``source_weights`` (default: the sources' available tokens). ``quality_scores`` (from
    ``score_key(source, file)`` to a number) selects the best-scored shards first.
    """
    corpus = corpus if isinstance(corpus, CorpusIndex) else index_of_manifests(corpus, seq_len)
    if seq_len is not None and seq_len != corpus.seq_len:
        raise PlanError(f"the corpus has seq_len {corpus.seq_len}, requested {seq_len}")
    if not isinstance(row_alignment, int) or isinstance(row_alignment, bool) or row_alignment < 1:
        raise PlanError(f"row_alignment must be a positive integer, got {row_alignment!r}")
    L = corpus.seq_len
    requested, budgets = _budgets({s: corpus.rows(s) * L for s in corpus.sources}, unique_tokens_budget,
                                  source_weights, source_budgets)
    passes = _passes(budgets, source_passes)
    if quality_scores is not None:
        check_quality_scores(corpus, budgets, quality_scores)
    core: dict[str, list] = {}
    for source, budget in budgets.items():
        rows = budget // L // row_alignment * row_alignment
        if rows == 0:
            raise PlanError(f"source {source!r} gets {budget} tokens, less than one aligned block of "
                            f"{row_alignment} rows x {L}; raise its budget or lower row_alignment")
        if rows > corpus.rows(source):
            raise PlanError(f"source {source!r} needs {rows} rows but its shards hold {corpus.rows(source)}; "
                            "lower the budget or tokenize more text")
        core[source] = select_rows(_ordered(corpus, source, quality_scores), rows)
    source_unique = {source: rows * L for source, rows in source_rows(core).items()}
    return plan_document(
        seq_len=L, selection_mode=MANIFEST_ORDER if quality_scores is None else QUALITY_SCORE,
        row_alignment=row_alignment, requested_unique_tokens=requested, unique_tokens=sum(source_unique.values()),
        source_unique_tokens=source_unique, source_passes=passes,
        phases=[{"name": UNIQUE_CORE, "passes": 1, "sources": core}, *replay_phases(core, passes)],
        dataset=dataset, revision=revision, identity=corpus.identity)
