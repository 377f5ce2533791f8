"""The one validation layer of corpus manifests, for both corpus layouts (docs/contracts.md §2b).

Two layouts hold the same shard bytes (little-endian uint16, ``rows·L + 1`` tokens a shard):

- ours: ``<root>/<source>/manifest.json`` + ``<root>/<source>/<file>``, no mixture manifest;
- the release's (``tr-hash-token-mixture-v1``): ``<root>/mixture_manifest.json`` +
  ``<root>/corpora/<source>/manifest.json`` + ``<root>/corpora/<source>/tokens-NNNNN.bin``.

The parse functions take an already decoded JSON object and an ``origin`` string (a local path
or an ``hf://`` address) used in every message, so a manifest read from disk and one read from
the Hub go through the same checks. Every rule the release's loader applies is checked here,
and every malformed value (a string where a number belongs, a boolean for an integer, a list
that is not a list) is an error naming the origin, the field and the fix, never a traceback.

The result is one normalized form, :class:`SourceManifest` (plus :class:`Mixture` for the
release's layout), whatever layout it came from. Both also read as mappings of their JSON keys
(``manifest["shards"]``, ``shard["rows"]``, ``manifest.get("tokenizer_sha256")``), so code written
against the manifest documents keeps working.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ds_trhash.errors import UserError

from ds_trhash.data.formats.json_fields import JsonFields, kind

MIXTURE_FORMAT = "tr-hash-token-mixture-v1"  # the release's format; our writer writes it too
LEGACY_FORMAT = "tr-hash-token-shards-v1"  # what our writer wrote before (still loads)
FORMATS = (MIXTURE_FORMAT, LEGACY_FORMAT)
DTYPE = "uint16"
DTYPE_ALIASES = ("uint16", "<u2")  # both spell little-endian uint16 (numpy's "<u2": our older manifests)
MIXTURE_FILE = "mixture_manifest.json"
SOURCE_MANIFEST = "manifest.json"
CORPORA_DIR = "corpora"
FIX = "rebuild the source with `ds-trhash data tokenize`, or fetch an intact copy of the corpus"


class ShardError(UserError, ValueError):
    """Shard data or a manifest is inconsistent with what the caller asked for."""


class ManifestError(ShardError):
    """A corpus manifest is malformed or breaks a layout rule; the message names file, field and fix."""


class _AsMapping(Mapping):
    """Read a frozen record like the JSON object it came from: ``_json`` pairs each JSON key with
    its attribute; the document's other fields (``extra``) follow. Equal to any mapping of the
    same items, so a loaded manifest equals the document that was written."""

    _json: tuple[tuple[str, str], ...] = ()

    def _table(self) -> dict:
        out = {key: _plain(getattr(self, attribute)) for key, attribute in self._json}
        for key, value in getattr(self, "extra", {}).items():
            out.setdefault(key, value)
        return out

    def __getitem__(self, key: str) -> object:
        for name, attribute in self._json:
            if name == key:
                return _plain(getattr(self, attribute))
        extra = getattr(self, "extra", {})
        if key in extra:
            return extra[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, eq=False)
class Shard(_AsMapping):
    _json = (("file", "file"), ("rows", "rows"), ("tokens", "tokens"), ("bytes", "bytes"), ("sha256", "sha256"))
    file: str
    rows: int
    tokens: int  # rows·seq_len + 1
    bytes: int  # 2·tokens
    sha256: str


@dataclass(frozen=True, eq=False)
class SourceManifest(_AsMapping):
    """One source's shards, normalized. ``tokenizer_sha256`` / ``vocab_size`` are None when the
    manifest records none (the release's never do)."""

    _json = (("format", "format"), ("source", "name"), ("seq_len", "seq_len"), ("dtype", "dtype"), ("rows", "rows"),
             ("total_rows", "rows"), ("shards", "shards"), ("tokenizer_sha256", "tokenizer_sha256"),
             ("vocab_size", "vocab_size"))
    name: str
    seq_len: int
    dtype: str
    rows: int
    shards: tuple[Shard, ...]
    format: str
    tokenizer_sha256: Optional[str] = None
    vocab_size: Optional[int] = None
    origin: str = ""
    extra: Mapping = field(default_factory=dict, repr=False)  # the document's other fields


@dataclass(frozen=True)
class MixtureSource:
    name: str
    rows: int
    manifest: str  # path of the source manifest, relative to the corpus root
    weight: Optional[float] = None
    trained_tokens: Optional[int] = None


@dataclass(frozen=True)
class Mixture:
    """The release's ``mixture_manifest.json``, normalized."""

    seq_len: int
    dtype: str
    sources: tuple[MixtureSource, ...]
    requested_tokens: Optional[int] = None
    actual_tokens: Optional[int] = None
    global_batch_sequences: Optional[int] = None
    origin: str = ""

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.sources)


# ----------------------------------------------------------------------------- field readers


class _Fields(JsonFields):
    error, fix = ManifestError, FIX


def _dtype(r: _Fields) -> str:
    r.choice("dtype", DTYPE_ALIASES)
    return DTYPE


# ----------------------------------------------------------------------------- source manifests


def _shard(entry: object, origin: str, index: int, seq_len: int) -> Shard:
    r = _Fields(entry, origin, f"shards[{index}]")
    file = r.name("file")
    rows = r.integer("rows", minimum=1)
    tokens = r.integer("tokens", minimum=2)
    if tokens != rows * seq_len + 1:
        raise r.fail("tokens", f"is {tokens}, but {rows} rows of seq_len {seq_len} hold rows·L+1 = {rows * seq_len + 1}")
    size = r.integer("bytes", minimum=1) if r.has("bytes") else 2 * tokens
    if size != 2 * tokens:
        raise r.fail("bytes", f"is {size}, but {tokens} uint16 tokens take 2·tokens = {2 * tokens} bytes")
    return Shard(file=file, rows=rows, tokens=tokens, bytes=size, sha256=r.sha256("sha256"))


def parse_source_manifest(doc: object, origin: str, expect_source: Optional[str] = None,
                          expect_seq_len: Optional[int] = None) -> SourceManifest:
    """Validate one source manifest (either format) and normalize it.

    ``expect_source``: the source name the manifest's location implies (its folder, or the
    mixture's entry); a manifest naming another source is refused. ``expect_seq_len``: the
    mixture's, checked before the shards are (which a wrong seq_len would all fail)."""
    r = _Fields(doc, origin)
    fmt = r.choice("format", FORMATS)
    name = r.name("source")
    if expect_source is not None and name != expect_source:
        raise r.fail("source", f"is {name!r}, but the manifest sits where source {expect_source!r} belongs")
    seq_len = r.integer("seq_len", minimum=1)
    if expect_seq_len is not None and seq_len != expect_seq_len:
        raise r.fail("seq_len", f"is {seq_len}, but the mixture manifest says {expect_seq_len}; every source of a "
                                "mixture has the mixture's seq_len")
    legacy = fmt == LEGACY_FORMAT
    dtype = _dtype(r) if (r.has("dtype") or not legacy) else DTYPE
    entries = r.array("shards")
    if not entries:
        raise r.fail("shards", "is empty; a source needs at least one shard")
    shards = tuple(_shard(entry, origin, i, seq_len) for i, entry in enumerate(entries))
    seen: dict[str, int] = {}
    for i, shard in enumerate(shards):
        if shard.file in seen:
            raise r.fail(f"shards[{i}].file", f"is {shard.file!r} again (also shards[{seen[shard.file]}]); "
                                              "shard files must be distinct")
        seen[shard.file] = i
    rows = sum(s.rows for s in shards)
    recorded = r.integer("total_rows" if legacy else "rows", minimum=1, required=not legacy)
    if legacy and r.has("rows"):
        recorded = r.integer("rows", minimum=1)
    if recorded is not None and recorded != rows:
        raise r.fail("total_rows" if legacy else "rows", f"is {recorded}, but its shards hold {rows} rows")
    if r.has("trained_tokens"):
        r.integer("trained_tokens")
    r.number("weight")
    tokenizer = r.text("tokenizer_sha256", required=legacy)  # our identity field: the release records none
    vocab = r.integer("vocab_size", minimum=1, required=legacy)
    normalized = {"format", "source", "seq_len", "dtype", "shards", "rows", "total_rows", "tokenizer_sha256",
                  "vocab_size"}
    extra = {k: v for k, v in r.doc.items() if k not in normalized}
    return SourceManifest(name=name, seq_len=seq_len, dtype=dtype, rows=rows, shards=shards, format=fmt,
                          tokenizer_sha256=tokenizer, vocab_size=vocab, origin=origin, extra=extra)


# ----------------------------------------------------------------------------- mixture manifest


def parse_mixture_manifest(doc: object, origin: str) -> Mixture:
    """Validate the release's ``mixture_manifest.json`` and normalize it. Each source's
    ``manifest`` must be ``corpora/<name>/manifest.json`` (checked as a relative path)."""
    r = _Fields(doc, origin)
    r.choice("format", (MIXTURE_FORMAT,))
    dtype = _dtype(r)
    seq_len = r.integer("seq_len", minimum=1)
    entries = r.array("sources")
    if not entries:
        raise r.fail("sources", "is empty; a mixture needs at least one source")
    sources, seen = [], set()
    for i, entry in enumerate(entries):
        s = _Fields(entry, origin, f"sources[{i}]")
        name = s.name("name")
        if name in seen:
            raise s.fail("name", f"is {name!r} again; each source is listed once")
        seen.add(name)
        path = s.text("manifest", required=False) or f"{CORPORA_DIR}/{name}/{SOURCE_MANIFEST}"
        if path != f"{CORPORA_DIR}/{name}/{SOURCE_MANIFEST}":
            raise s.fail("manifest", f"is {path!r}; in this layout it must be "
                                     f"'{CORPORA_DIR}/{name}/{SOURCE_MANIFEST}'")
        rows = s.integer("rows", minimum=1)
        trained = s.integer("trained_tokens", required=False)
        sources.append(MixtureSource(name=name, rows=rows, manifest=path, weight=s.number("weight"),
                                     trained_tokens=trained))
    return Mixture(seq_len=seq_len, dtype=dtype, sources=tuple(sources), origin=origin,
                   requested_tokens=r.integer("requested_tokens", required=False),
                   actual_tokens=r.integer("actual_tokens", required=False),
                   global_batch_sequences=r.integer("global_batch_sequences", required=False))


def check_against_mixture(mixture: Mixture, manifests: Mapping[str, SourceManifest]) -> None:
    """The release's cross-file rules: every listed source has its manifest, the same seq_len and
    dtype as the mixture, and shard rows summing to the mixture's rows for it."""
    for entry in mixture.sources:
        manifest = manifests.get(entry.name)
        if manifest is None:
            raise ManifestError(f"{mixture.origin} lists source {entry.name!r}, whose {entry.manifest} is missing; {FIX}")
        if manifest.seq_len != mixture.seq_len:
            raise ManifestError(f"{manifest.origin} field 'seq_len' is {manifest.seq_len}, but {mixture.origin} says "
                                f"{mixture.seq_len}; every source of a mixture has the mixture's seq_len; {FIX}")
        if manifest.rows != entry.rows:
            raise ManifestError(f"{manifest.origin}: its shards hold {manifest.rows} rows, but {mixture.origin} field "
                                f"'rows' of source {entry.name!r} is {entry.rows}; {FIX}")
