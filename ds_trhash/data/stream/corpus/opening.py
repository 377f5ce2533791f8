"""The one question a launch asks the data: can this plan be read from this store, and how?

``open_corpus`` resolves the store's revision to a commit (once; a resume passes the commit its
checkpoint recorded), takes one file listing, reads each planned source's manifest, and checks,
without reading any shard's bytes: the plan agrees with the manifests (seq_len, tokenizer, rows),
and every planned shard is in the listing with its manifest size (and its SHA-256, where the
listing carries one). ``deep`` hashes every planned shard as well (``ds-trhash preflight --deep``).
Shard bytes are otherwise verified as they enter the node's cache (``data.cache``).
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

import torch.distributed as dist

from ds_trhash.errors import UserError
from ds_trhash.io import sha256_file
from ds_trhash.ranks import is_multi_rank

from ds_trhash.safe_names import bare_name

from ds_trhash.data.stream.cache import CACHE_ENV, GIB, CacheError, ExpectedShard, ShardCache, prefetch_depth
from ds_trhash.data.formats.layout import LAYOUT_OURS, LAYOUT_RELEASE
from ds_trhash.data.formats.manifest import (CORPORA_DIR, MIXTURE_FILE, SOURCE_MANIFEST, SourceManifest, check_against_mixture,
                       parse_mixture_manifest, parse_source_manifest)
from ds_trhash.data.plans.plan import PlanLike, plan_doc
from ds_trhash.data.stream.corpus.pinning import pinned_commit
from ds_trhash.data.stream.store import LOCAL_COMMIT, LocalStore, ShardStore, StoreFile, open_store
from ds_trhash.data.stream.types import Key

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHOWN = 5
PREFETCH_SHARDS = 2  # shards the cache fetches ahead of the reader (ShardCache prefetch)


class CorpusError(UserError, ValueError):
    """The plan cannot be read from its store as it stands (names the shard or the file)."""


def source_dir(layout: str) -> str:
    """The folder holding ``<source>/`` in a store of that layout ("" for ours)."""
    return f"{CORPORA_DIR}/" if layout == LAYOUT_RELEASE else ""


def shard_store_path(layout: str, source: str, file: str, origin: str = "the plan") -> str:
    """A shard's path in the store; both names must be bare (they come from plans and manifests)."""
    return f"{source_dir(layout)}{bare_name(source, origin, 'source')}/{bare_name(file, origin, f'{source}.file')}"


def read_manifests(store: ShardStore, listing: Mapping[str, StoreFile], sources: list[str],
                   seq_len: int) -> tuple[str, dict[str, SourceManifest]]:
    """(layout, the planned sources' manifests), validated by the one manifest layer: the
    release's layout when the store holds a mixture manifest, else ours."""
    layout = LAYOUT_RELEASE if MIXTURE_FILE in listing else LAYOUT_OURS
    mixture = None
    if layout == LAYOUT_RELEASE:
        mixture = parse_mixture_manifest(store.read_json(MIXTURE_FILE), f"{MIXTURE_FILE} in {store.description}")
        unknown = sorted(set(sources) - {m.name for m in mixture.sources})
        if unknown:
            raise CorpusError(f"the plan reads source(s) {', '.join(map(repr, unknown))}, which {MIXTURE_FILE} in "
                              f"{store.description} does not list; the plan is for another corpus")
    found = {}
    for source in sources:
        where = f"{source_dir(layout)}{bare_name(source, 'the plan', 'source')}/{SOURCE_MANIFEST}"
        if where not in listing:
            raise CorpusError(f"{store.description} has no {where}; the plan reads source {source!r} "
                              "(wrong data.shards_dir or revision?)")
        found[source] = parse_source_manifest(store.read_json(where), f"{where} in {store.description}", source,
                                              mixture.seq_len if mixture else None)
    if mixture is not None:
        check_against_mixture(mixture, found)
    return layout, found


def planned_shards(doc: Mapping) -> dict[Key, None]:
    """Every (source, file) the plan reads, in plan order."""
    needed: dict[Key, None] = {}
    for phase in doc["phases"]:
        for source, entries in phase["sources"].items():
            for entry in entries:
                needed[(source, entry["file"])] = None
    return needed


def check_plan_manifests(doc: Mapping, manifests: Mapping[str, SourceManifest]) -> None:
    """The plan against its sources' manifests: seq_len, tokenizer, and every planned shard in its
    manifest with at least the rows the plan takes of it."""
    planned_tokenizer = doc.get("tokenizer_sha256")
    for source, manifest in manifests.items():
        if manifest.seq_len != doc["seq_len"]:
            raise CorpusError(f"source {source!r} shards have seq_len {manifest.seq_len}, the plan {doc['seq_len']}")
        if planned_tokenizer and manifest.tokenizer_sha256 and manifest.tokenizer_sha256 != planned_tokenizer:
            raise CorpusError(f"source {source!r} was tokenized with {manifest.tokenizer_sha256}, "
                              f"the plan expects tokenizer {planned_tokenizer}")
    for phase in doc["phases"]:
        for source, entries in phase["sources"].items():
            rows = {shard.file: shard.rows for shard in manifests[source].shards}
            for entry in entries:
                if rows.get(entry["file"], -1) < entry["rows"]:
                    raise CorpusError(
                        f"plan phase {phase['name']!r} takes {entry['rows']} rows of {source}/{entry['file']}, "
                        f"its manifest lists {rows.get(entry['file'], 'no such shard')}; the plan and the shards disagree")


@dataclass
class Corpus:
    store: ShardStore
    commit: str
    manifests: dict[str, SourceManifest]
    layout: str = LAYOUT_OURS
    shards: dict[Key, ExpectedShard] = field(default_factory=dict)  # the planned ones
    plan: Optional[Mapping] = None  # the plan document read (its phases say which sources are read at once)

    @property
    def record(self) -> dict:
        """What checkpoints and the run record keep (never a token): the store, the revision asked
        for and the commit it resolved to, and every planned shard's SHA-256 as its manifest gave
        it, so a later stage or resume proves it reads the same bytes (``stream.pinning``)."""
        return {"store": self.store.identity, "commit": self.commit, "revision": getattr(self.store, "revision", None),
                "shards": {shard.path: shard.sha256 for shard in sorted(self.shards.values(), key=lambda s: s.path)}}

    def sources_at_once(self) -> int:
        """The most sources one phase interleaves: a reader holds a shard of each at once."""
        return max((len(phase["sources"]) for phase in plan_doc(self.plan)["phases"]), default=1) if self.plan else 1

    def min_cache_bytes(self, ranks_on_node: int, prefetch: int = PREFETCH_SHARDS) -> int:
        """What the node's ranks hold at once, and the prefetch beside it, in largest shards: a
        shard of every source read at once (or one per rank, when the ranks outnumber them), plus
        the shards fetched ahead. Below this the cache evicts what it is about to read again."""
        largest = max((s.size for s in self.shards.values()), default=0)
        return largest * (max(ranks_on_node, self.sources_at_once()) + prefetch)

    def check_cache_bound(self, max_bytes: int, ranks_on_node: int, setting: str) -> None:
        need = self.min_cache_bytes(ranks_on_node)
        if max_bytes < need:
            largest = max((s.size for s in self.shards.values()), default=0)
            raise CacheError(
                f"{setting} allows {max_bytes} bytes, but the cache must hold {need // max(largest, 1)} of the largest "
                f"planned shard ({largest} bytes) at once: a shard of each of the {self.sources_at_once()} sources read "
                f"at once (or one per rank: {ranks_on_node} on this node, whichever is more), plus {PREFETCH_SHARDS} "
                f"fetched ahead; the smallest bound that works is {need} bytes = {need / GIB:.6g} GiB; raise "
                f"data.cache_gb or {CACHE_ENV}")

    def open_cache(self, cache_dir: os.PathLike | str, max_bytes: int, prefetch: Optional[int] = None,
                   ranks_on_node: int = 1, fetch_process: bool = False) -> ShardCache:
        """The node's cache of this corpus; each of the node's ``ranks_on_node`` readers holds at
        most its share of ``max_bytes`` at once; ``prefetch``: shards fetched ahead (by default
        ``PREFETCH_SHARDS``, more when the bound has room: ``cache_bound.prefetch_depth``);
        ``fetch_process``: prefetches run in a process beside this one (``fetcher``), as in training."""
        if prefetch is None:
            largest = max((s.size for s in self.shards.values()), default=0)
            prefetch = prefetch_depth(max_bytes, ranks_on_node, largest, PREFETCH_SHARDS, self.sources_at_once())
        return ShardCache(self.store, cache_dir, max_bytes, self.shards, commit=self.commit, prefetch=prefetch,
                          ranks_on_node=ranks_on_node, fetch_process=fetch_process)


def _shown(problems: list[str]) -> str:
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return "; ".join(problems[:_SHOWN]) + more


def _hash_problems(store: ShardStore, shards: Mapping[Key, ExpectedShard],
                   listing: Optional[Mapping[str, StoreFile]] = None) -> list[str]:
    """``--deep``: the bytes of every planned shard. A local shard is hashed in place; a remote one
    whose listing carries the store's own SHA-256 (the Hub's LFS record, compared with the manifest
    when the listing was read) is not downloaded; any other is hashed through a temporary file."""
    problems = []
    listing = listing or {}
    with tempfile.TemporaryDirectory(prefix="ds-trhash-deep-") as tmp:
        for (source, file), shard in shards.items():
            if isinstance(store, LocalStore):
                digest = sha256_file(store.root / shard.path)
            elif (recorded := getattr(listing.get(shard.path), "sha256", None)):
                digest = recorded  # the store's own record, not a download
            else:
                dest = Path(tmp) / "shard"
                dest.write_bytes(b"")
                store.download(shard.path, dest, shard.size)
                digest = sha256_file(dest)
                dest.unlink()
            if digest != shard.sha256:
                problems.append(f"{shard.path} has sha256 {digest}, its manifest {shard.sha256}")
    return problems


def open_corpus(plan: PlanLike, shards_dir: Optional[str], origin: str = "the config", pinned: Optional[str] = None,
                deep: bool = False, store: Optional[ShardStore] = None, hub_wait_s: Optional[float] = None) -> Corpus:
    """The plan's corpus, checked as the module docstring says; raises CorpusError / StoreError."""
    doc = plan_doc(plan)
    store = store or open_store(shards_dir, doc, origin, hub_wait_s)
    commit = store.resolve(pinned)
    listing = store.list_files()
    layout, manifests = read_manifests(store, listing, sorted({s for s, _ in planned_shards(doc)}), doc["seq_len"])
    corpus = corpus_at(doc, store, commit, layout, manifests, listing)
    if deep:
        problems = _hash_problems(store, corpus.shards, listing)
        if problems:
            raise CorpusError(f"the shards in {store.description} do not match their manifests' SHA-256: "
                              f"{_shown(problems)}; restore them, or re-tokenize and re-plan")
    return corpus


def corpus_at(plan: PlanLike, store: ShardStore, commit: str, layout: str, manifests: dict[str, SourceManifest],
              listing: Optional[Mapping[str, StoreFile]] = None) -> Corpus:
    """The corpus from manifests already read (by rank 0, shared with the others): plan checks,
    and with ``listing`` every planned shard present with its manifest size."""
    doc = plan_doc(plan)
    store.pin(commit)
    check_plan_manifests(doc, manifests)
    shards, problems = {}, []
    for source, file in planned_shards(doc):
        entry = next(s for s in manifests[source].shards if s.file == file)
        shard = ExpectedShard(shard_store_path(layout, source, file), entry.sha256, entry.bytes)
        size = entry.bytes
        shards[(source, file)] = shard
        found = listing.get(shard.path) if listing is not None else shard
        if found is None:
            problems.append(f"{shard.path} is missing (the plan reads it)")
        elif found.size != size:
            problems.append(f"{shard.path} holds {found.size} bytes, its manifest {size}")
        elif found.sha256 and found.sha256 != shard.sha256:
            problems.append(f"{shard.path} has sha256 {found.sha256} in the listing, its manifest {shard.sha256}")
    if problems:
        at = "" if commit == LOCAL_COMMIT else f" at commit {commit}"
        raise CorpusError(f"the shards in {store.description}{at} do not match the plan: {_shown(problems)}; "
                          "restore them, or re-tokenize and re-plan")
    return Corpus(store, commit, manifests, layout, shards, plan=doc)


def shared_corpus(plan: PlanLike, shards_dir: Optional[str], origin: str, saved: Optional[Mapping], rank: int, deep: bool,
                   hub_wait_s: Optional[float] = None) -> Corpus:
    """Rank 0 asks the store (one revision look-up, one listing, the manifests) and hands the
    answer, or its refusal, to every rank: N ranks never make N look-ups at once. ``saved``: the
    record this launch is held to (``stream.pinning``): its commit is read again when it is of this
    store."""
    store = open_store(shards_dir, plan_doc(plan), origin, hub_wait_s)
    pinned = pinned_commit(saved, store)
    if not is_multi_rank():
        return open_corpus(plan, shards_dir, origin, pinned=pinned, deep=deep, store=store)
    payload: list = [None]
    if rank == 0:
        try:
            corpus = open_corpus(plan, shards_dir, origin, pinned=pinned, deep=deep, store=store)
            payload = [(corpus.commit, corpus.layout, corpus.manifests, None)]
        except UserError as exc:
            payload = [(None, None, None, str(exc))]
    dist.broadcast_object_list(payload, src=0)
    commit, layout, manifests, refusal = payload[0]
    if refusal is not None:
        raise CorpusError(refusal)
    return corpus if rank == 0 else corpus_at(plan, store, commit, layout, manifests)


def resume_commit(shards_dir: str | None, doc: Mapping, saved_source: dict | None) -> str | None:
    """The commit a resume reads: the one its checkpoint recorded, even if the branch moved since.
    Asking for another commit explicitly (``@<commit>``) is refused, naming both."""
    commit = (saved_source or {}).get("commit")
    if not commit or commit == LOCAL_COMMIT:
        return None
    spec = shards_dir if shards_dir and shards_dir.startswith("hf://") else doc.get("dataset")
    asked = spec.partition("@")[2] if isinstance(spec, str) and "@" in spec else str(doc.get("revision") or "")
    if _COMMIT.match(asked) and asked != commit:
        raise CorpusError(f"this run read commit {commit} of its dataset (recorded in its checkpoint); the launch "
                          f"asks for commit {asked}: a resume reads the commit it started on; drop the revision, "
                          "or start a new run with --init-checkpoint")
    return commit
