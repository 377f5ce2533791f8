"""What a plan builder needs of a corpus: per source, its shards' names and row counts in manifest
order, and the corpus's seq_len (docs/contracts.md §2, §2b). Read from manifests alone.

A plan over 200B tokens is a selection of a few hundred shard names, so building one must never
open a shard: this index is everything the builders (``plan_build``, ``plan_correct``) see. It is
read from either layout, ours (``<root>/<source>/manifest.json``) or the release's
(``mixture_manifest.json`` + ``corpora/<source>/manifest.json``), through the manifests' one
validation layer (``manifest``, ``corpus``). ``read_corpus_index`` is the one entry point.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, cast

from ds_trhash.errors import UserError

from ds_trhash.data.formats.layout import read_corpus
from ds_trhash.data.formats.manifest import MIXTURE_FILE as MIXTURE_MANIFEST
from ds_trhash.data.formats.shards import check_source_name, load_manifests
from ds_trhash.data.formats.tokenizer import PathLike


class CorpusIndexError(UserError, ValueError):
    """A corpus's manifests cannot say which shards and rows it holds."""


@dataclass(frozen=True)
class ShardRows:
    file: str  # bare file name inside the source's directory
    rows: int


@dataclass(frozen=True)
class CorpusIndex:
    seq_len: int
    sources: dict[str, tuple[ShardRows, ...]]  # manifest order of sources and of their shards
    # Tokenizer identity carried into a plan when the manifests record it (ours do, the release's not).
    identity: dict = field(default_factory=dict)

    def rows(self, source: str) -> int:
        return sum(shard.rows for shard in self.sources[source])


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _shards(entries: object, where: str) -> tuple[ShardRows, ...]:
    if not isinstance(entries, list) or not entries:
        raise CorpusIndexError(f"{where} lists no shards; a source needs at least one")
    out, seen = [], set()
    for entry in entries:
        name = entry.get("file") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
            raise CorpusIndexError(f"{where} has shard entry {entry!r}; each needs a bare file name (no directory)")
        if name in seen:
            raise CorpusIndexError(f"{where} lists shard {name} twice")
        if not _positive_int(entry.get("rows")):
            raise CorpusIndexError(f"{where} shard {name} has rows {entry.get('rows')!r}; expected a positive integer")
        seen.add(name)
        out.append(ShardRows(name, entry["rows"]))
    return tuple(out)


def _release_index(root: Path) -> CorpusIndex:
    """The release's layout, read and validated by the one manifest layer (``corpus.read_corpus``:
    the mixture, each source's manifest, and every rule between them)."""
    corpus = read_corpus(root)
    return CorpusIndex(corpus.seq_len, {name: tuple(ShardRows(s.file, s.rows) for s in m.shards)
                                        for name, m in corpus.sources.items()})


def index_of_manifests(manifests: Mapping[str, Mapping], seq_len: Optional[int] = None) -> CorpusIndex:
    """The index of our shard manifests (by source, as ``shards.load_manifests`` returns them)."""
    if not manifests:
        raise CorpusIndexError("no shard manifests given; pass at least one source")
    for source, manifest in manifests.items():
        check_source_name(source)
        if manifest.get("source", source) != source:
            raise CorpusIndexError(f"manifest for {source!r} says source {manifest.get('source')!r}")
    lengths = {source: m.get("seq_len") for source, m in manifests.items()}
    if len(set(lengths.values()) | ({seq_len} if seq_len else set())) != 1:
        raise CorpusIndexError(f"manifests disagree on seq_len: {lengths}" + (f" (requested {seq_len})" if seq_len else ""))
    identity = {}
    for key in ("vocab_size", "tokenizer_sha256"):
        values = {source: m.get(key) for source, m in manifests.items()}
        if len(set(values.values())) != 1:
            raise CorpusIndexError(f"manifests disagree on {key}: {values}; a plan covers one tokenization")
        identity[key] = next(iter(values.values()))
    sources = {source: _shards(m.get("shards"), f"shard manifest of {source!r}") for source, m in manifests.items()}
    return CorpusIndex(int(cast(int, next(iter(lengths.values())))), sources, identity)


def read_corpus_index(paths: Sequence[PathLike], seq_len: Optional[int] = None) -> CorpusIndex:
    """The index of the corpus at ``paths``: one release-layout root (holding mixture_manifest.json),
    or our manifest files, source directories or shard roots. ``seq_len``, when given, must match."""
    roots = [Path(p) for p in paths]
    if not roots:
        raise CorpusIndexError("no manifest path given; pass a corpus directory or manifest files")
    release = [p for p in roots if (p / MIXTURE_MANIFEST).is_file() or p.name == MIXTURE_MANIFEST]
    if release:
        if len(roots) != 1:
            raise CorpusIndexError(f"{release[0]} is a whole corpus in the release's layout; pass it alone")
        root = roots[0].parent if roots[0].name == MIXTURE_MANIFEST else roots[0]
        index = _release_index(root)
        if seq_len is not None and seq_len != index.seq_len:
            raise CorpusIndexError(f"{root / MIXTURE_MANIFEST} has seq_len {index.seq_len}, requested {seq_len}")
        return index
    return index_of_manifests(load_manifests(roots), seq_len)
