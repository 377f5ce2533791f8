"""What the shard cache and the launch checks need from wherever a corpus lives.

A store is one corpus at one pinned revision: it resolves that revision to a commit once, lists
every file with its size in one request, reads a small JSON file, and writes one file's bytes
into a local file the cache prepared. The reader and the cache never learn more than this, so
another kind of store (``s3://``, ``gs://`` through fsspec) only has to implement these four.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from ds_trhash.errors import UserError
from ds_trhash.hub_access import repo_id_problem
from ds_trhash.safe_names import UnsafeNameError, relative_path


HF_PREFIX = "hf://datasets/"
_REPO_SHAPE = re.compile(r"^[^/]+/[^/]+$")  # the cheap part; the rest is the client's validator


class StoreError(UserError, ValueError):
    """The store cannot give what the launch needs (unreachable, missing file, bad revision)."""


class StoreUnavailable(StoreError, ConnectionError):
    """A transient failure outlived its wait budget: names the file and the endpoint."""

    per_rank = True


class ReadTimedOut(StoreUnavailable):
    """A read's waits together (a download lock, the store's retries) outlasted its budget
    (``data.hub_wait_minutes``: ``deadline``)."""


@dataclass(frozen=True)
class StoreFile:
    path: str  # relative, "/"-separated
    size: int
    sha256: Optional[str] = None  # when the listing carries it (LFS files on the Hub)


def relative_name(path: str, origin: str) -> str:
    """A store path from an untrusted listing or manifest, by ``safe_names.relative_path``."""
    try:
        return relative_path(path, origin)
    except UnsafeNameError as exc:
        raise StoreError(f"{origin}: {path!r} is not a plain relative file name ({exc})") from None


def parse_hf_url(url: str, origin: str) -> tuple[str, Optional[str]]:
    """``hf://datasets/OWNER/REPO[@REVISION]`` -> (repo id, revision or None); the repository id
    by ``hub_access.repo_id_problem``, the one check of every id."""
    rest = url[len(HF_PREFIX):] if isinstance(url, str) and url.startswith(HF_PREFIX) else None
    repo, _, revision = (rest or "").partition("@")
    if rest is None or (rest.count("@") and not revision) or not _REPO_SHAPE.match(repo):
        raise StoreError(f"{origin}: {url!r} is not hf://datasets/OWNER/REPO[@REVISION]")
    problem = repo_id_problem(repo)
    if problem:
        raise StoreError(f"{origin}: {url!r} is not hf://datasets/OWNER/REPO[@REVISION] ({problem})")
    return repo, revision or None


class ShardStore(Protocol):
    """One corpus at one revision (see the module docstring)."""

    description: str  # what messages name: a path, or hf://datasets/OWNER/REPO plus endpoint
    identity: str  # stable text naming the store and its commit (cache folder, run record)

    def resolve(self, pinned: Optional[str] = None) -> str:
        """The commit this store reads (``pinned``: a commit recorded earlier, kept as is)."""

    def pin(self, commit: str) -> None:
        """Read ``commit`` from now on without asking the store (another rank resolved it)."""

    def list_files(self) -> dict[str, StoreFile]:
        """Every file at the commit, by relative path, from one listing."""

    def read_json(self, path: str) -> object:
        """The decoded JSON file at ``path``."""

    def warm_up(self) -> None:
        """Set up now what the first download would (a client, its session): a prefetch process
        calls it as it starts, so that no read waits for that set-up."""

    def download(self, path: str, dest: Path, size: int) -> Optional[str]:
        """Write the file's ``size`` bytes into ``dest`` (an existing file, overwritten from 0) and
        return the sha256 of the bytes written, hashed as they were written, so the cache never
        reads a shard back to verify it (None: this store cannot; the cache then hashes the file)."""


def copy_hashing(src: Path, dest: Path, chunk: int = 1 << 20) -> str:
    """Copy ``src`` over ``dest`` (an existing file, overwritten from 0), hashing the bytes on the
    way: the sha256 a store returns from ``download`` without reading the copy back."""
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(dest, "r+b") as fout:
        while block := fin.read(chunk):
            fout.write(block)
            digest.update(block)
        fout.truncate()
    return digest.hexdigest()
