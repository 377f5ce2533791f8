"""A local corpus directory of either layout, read into one normalized form (docs/contracts.md §2b).

``read_corpus(root)`` tells the layouts apart by ``mixture_manifest.json``: present, it is the
release's (sources under ``corpora/``, checked against the mixture); absent, ours (sources are
``root``'s subfolders). Either way the result names ``sources_dir``, the folder that holds
``<source>/manifest.json`` and ``<source>/<file>``, so readers, checks and the cache address a
shard as ``sources_dir / source / file`` whatever the layout. Every name taken from a manifest
or a plan passes ``ds_trhash.safe_names`` before a path is built from it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ds_trhash.safe_names import bare_name, resolve_under

from ds_trhash.data.formats.manifest import (
    CORPORA_DIR, FIX, MIXTURE_FILE, SOURCE_MANIFEST, ManifestError, Mixture, SourceManifest,
    check_against_mixture, parse_mixture_manifest, parse_source_manifest,
)
from ds_trhash.data.formats.tokenizer import PathLike

LAYOUT_OURS = "ds-trhash"
LAYOUT_RELEASE = "release"


@dataclass(frozen=True)
class CorpusDir:
    """A local corpus directory of either layout, read from its manifests (``stream.corpus.Corpus``
    is a corpus opened for training from any store, local or Hub)."""
    root: Path
    layout: str  # LAYOUT_OURS or LAYOUT_RELEASE
    sources_dir: Path  # holds <source>/manifest.json and <source>/<file>
    sources: dict[str, SourceManifest]
    mixture: Optional[Mixture] = None

    def shard_path(self, source: str, file: str, origin: str = "the plan") -> Path:
        """Where a shard lies; a name that would leave the corpus (``..``, a symlink out) is refused."""
        return shard_path_under(self.sources_dir, source, file, origin)

    @property
    def seq_len(self) -> int:
        return next(iter(self.sources.values())).seq_len


def shard_path_under(sources_dir: Path, source: str, file: str, origin: str = "the plan") -> Path:
    """``sources_dir / source / file`` for bare names that stay inside it (no symlink out)."""
    bare_name(source, origin, "source")
    bare_name(file, origin, f"{source}.file")
    return resolve_under(sources_dir, f"{source}/{file}", origin, f"{source}/{file}")


def read_json(path: Path, what: str) -> object:
    """A JSON file's decoded content; every way it can be unreadable is one message naming it."""
    if path.is_dir():
        raise ManifestError(f"{what} {path} is a directory, not a file; point at the manifest file or its folder")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"no {what} at {path}; run `ds-trhash data tokenize` for that source first, "
                            "or point at the corpus root") from None
    except OSError as exc:
        raise ManifestError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ManifestError(f"{what} {path} line {line} is not UTF-8 (byte {exc.start}); {FIX}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg}); {FIX}") from None


def read_source_manifest(path: PathLike, expect_source: Optional[str] = None,
                         expect_seq_len: Optional[int] = None) -> SourceManifest:
    """One source manifest from its file or the folder holding it (either format)."""
    file = Path(path)
    if file.is_dir():
        file = file / SOURCE_MANIFEST
    return parse_source_manifest(read_json(file, "shard manifest"), str(file), expect_source, expect_seq_len)


def is_release_layout(root: PathLike) -> bool:
    return (Path(root) / MIXTURE_FILE).is_file()


def sources_dir(root: PathLike) -> Path:
    """The folder holding ``<source>/<file>`` under a corpus root of either layout."""
    return Path(root) / CORPORA_DIR if is_release_layout(root) else Path(root)


def _check_seq_lens(sources: Mapping[str, SourceManifest]) -> None:
    lengths = {name: m.seq_len for name, m in sources.items()}
    if len(set(lengths.values())) > 1:
        raise ManifestError(f"the sources disagree on seq_len ({lengths}); one corpus has one seq_len: "
                            "re-tokenize the odd ones or keep them in another corpus")


def read_corpus(root: PathLike, sources: Optional[Iterable[str]] = None, origin: str = "the plan") -> CorpusDir:
    """The corpus at ``root`` (either layout), its manifests validated. ``sources``: read only
    these (a plan's), each name checked as a bare name taken from ``origin``."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"corpus {root} is not a directory; point data.shards_dir (or --manifest) at the "
                            "folder holding the sources")
    wanted = None if sources is None else [bare_name(s, origin, "source") for s in sources]
    if is_release_layout(root):
        mixture = parse_mixture_manifest(read_json(root / MIXTURE_FILE, "mixture manifest"), str(root / MIXTURE_FILE))
        listed = {s.name for s in mixture.sources}
        unknown = sorted(set(wanted or ()) - listed)
        if unknown:
            raise ManifestError(f"{origin} reads source(s) {', '.join(map(repr, unknown))}, which {root / MIXTURE_FILE} "
                                f"does not list ({', '.join(sorted(listed))}); the plan is for another corpus")
        names = wanted if wanted is not None else [s.name for s in mixture.sources]
        found = {}
        for name in names:
            path = resolve_under(root, f"{CORPORA_DIR}/{name}/{SOURCE_MANIFEST}", str(root / MIXTURE_FILE), "sources")
            if not path.is_file():
                raise ManifestError(f"{path} is missing, but {root / MIXTURE_FILE} lists source {name!r}; {FIX}")
            found[name] = read_source_manifest(path, name, mixture.seq_len)
        check_against_mixture(mixture, found)
        corpus = CorpusDir(root, LAYOUT_RELEASE, root / CORPORA_DIR, found, mixture)
    else:
        if wanted is None:
            names = [d.name for d in sorted(root.iterdir()) if (d / SOURCE_MANIFEST).is_file()]
            if not names:
                raise ManifestError(f"{root} holds neither {MIXTURE_FILE} nor source folders with a {SOURCE_MANIFEST}")
        else:
            names = wanted
        found = {name: read_source_manifest(resolve_under(root, f"{name}/{SOURCE_MANIFEST}", origin, "source"), name)
                 for name in names}
        corpus = CorpusDir(root, LAYOUT_OURS, root, found)
    _check_seq_lens(corpus.sources)
    return corpus


def load_any(paths: Iterable[PathLike]) -> dict[str, SourceManifest]:
    """Manifests by source from manifest files, source folders, or corpus roots of either layout."""
    found: dict[str, SourceManifest] = {}
    for path in map(Path, paths):
        if path.is_file() or (path / SOURCE_MANIFEST).is_file():
            manifests = [read_source_manifest(path)]
        elif path.is_dir():
            manifests = list(read_corpus(path).sources.values())
        else:
            raise ManifestError(f"manifest path {path} does not exist")
        for manifest in manifests:
            if manifest.name in found:
                raise ManifestError(f"source {manifest.name!r} is given twice (again in {path})")
            found[manifest.name] = manifest
    return found
