"""One Hub download per shard per job, however many nodes read it: a store that stages shards.

Several nodes read the same shards at about the same time (every step's rows are cut from one
global order, so every node reads every shard of the pass). Read straight from the Hub, each node
would download each shard: N nodes, N times the egress and the requests. This store sits between a
node's cache and the Hub store and shares each download through a folder every node sees (the
job's output directory, on the shared filesystem of a multi-node job):

- the first node that needs a shard **claims** it (a file created with ``O_EXCL``, which shared
  filesystems make atomic; no ``flock`` is needed), downloads it from the Hub into its own cache
  as usual, and **stages** a copy (written aside, then renamed into place);
- every other node that needs it waits for the staged copy and copies it into its cache; the
  bytes are verified against the Hub's own SHA-256 (the listing's LFS record) on the way, so a
  corrupt copy is dropped and fetched again;
- the node whose copy makes every node's **taken** mark complete deletes the staged file, so the
  folder holds only shards some node has yet to take.

A claim whose owner died (nothing staged after ``claim_timeout_s``) is broken and claimed again.
What each rank trains on is unchanged: the rows come from the same verified bytes, so losses at a
world size are bit-identical whatever the node count, and a job that loses a node resumes on
fewer exactly as before (the node count only decides who downloads).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from ds_trhash.data.stream.store.base import ShardStore, StoreFile, copy_hashing, relative_name

_CHUNK = 1 << 20
CLAIM, TAKEN = ".claim", ".taken-"
STAGING_DIR = "shard_staging"  # under the job's output directory
POLL_S = 0.1  # the longest wait between two looks for a staged copy
POLL_FIRST_S = 0.005  # the first: a copy is often staged within milliseconds (the wait doubles up to POLL_S)


class StagedStore:
    """``inner`` (a Hub store) shared by ``nodes`` nodes through ``staging`` (see the module)."""

    def __init__(self, inner: ShardStore, staging: os.PathLike | str, node: int, nodes: int,
                 expected: Optional[dict[str, str]] = None, claim_timeout_s: float = 600.0) -> None:
        self.inner, self.node, self.nodes = inner, int(node), int(nodes)
        self.staging = Path(staging)
        self.claim_timeout_s = float(claim_timeout_s)
        self.identity, self.description = inner.identity, inner.description
        self.staged_copies = 0  # shards this node took from the staging folder (tests, the benchmark)
        self._expected: dict[str, Optional[str]] = dict(expected or {})  # path -> the manifest's sha256

    def __getattr__(self, name: str) -> Any:  # revision, head, patience, ...: the inner store's
        if name.startswith("__") or "inner" not in self.__dict__:  # copying or unpickling: not yet
            raise AttributeError(name)
        return getattr(self.inner, name)

    def resolve(self, pinned: Optional[str] = None) -> str:
        return self.inner.resolve(pinned)

    def warm_up(self) -> None:
        self.inner.warm_up()

    def pin(self, commit: str) -> None:
        self.inner.pin(commit)
        self.description = self.inner.description

    def list_files(self) -> dict[str, StoreFile]:
        found = self.inner.list_files()
        self._expected.update({path: entry.sha256 for path, entry in found.items() if entry.sha256})
        return found

    def read_json(self, path: str) -> Any:
        return self.inner.read_json(path)

    def _folder(self) -> Path:
        commit = getattr(self.inner, "commit", None) or "unpinned"
        return self.staging / hashlib.sha256(f"{self.identity}@{commit}".encode()).hexdigest()[:16]

    def download(self, path: str, dest: Path, size: int) -> Optional[str]:
        staged = self._folder() / relative_name(path, f"staging of {self.description}")
        deadline, wait = time.monotonic() + self.claim_timeout_s, POLL_FIRST_S
        while True:
            if staged.is_file():
                digest = self._take(staged, dest, path)
                if digest is not None:
                    return digest
            elif self._claim(staged):
                return self._fetch_and_stage(path, dest, size, staged)
            elif time.monotonic() > deadline:  # the claimer died without staging it: claim it again
                _unlink(_side(staged, CLAIM))
                deadline = time.monotonic() + self.claim_timeout_s
            time.sleep(wait)
            wait = min(POLL_S, 2 * wait)

    def _claim(self, staged: Path) -> bool:
        staged.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(_side(staged, CLAIM), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, f"node {self.node}\n".encode())
        os.close(fd)
        return True

    def _fetch_and_stage(self, path: str, dest: Path, size: int, staged: Path) -> Optional[str]:
        try:
            digest = self.inner.download(path, dest, size)
        except BaseException:
            _unlink(_side(staged, CLAIM))  # another node may try
            raise
        expected = self._expected.get(path)
        if digest is None or (expected and digest != expected) or dest.stat().st_size != size:
            _unlink(_side(staged, CLAIM))  # not staged: the cache sees the mismatch and fetches again
            return digest
        aside = _side(staged, f".partial-{self.node}")
        shutil.copyfile(dest, aside)
        os.replace(aside, staged)
        self._mark_taken(staged)
        return digest

    def _take(self, staged: Path, dest: Path, path: str) -> Optional[str]:
        """Copy the staged file into ``dest``, hashing it; None (and the copy dropped) when it is
        not the Hub's bytes or vanished under us (taken by every node meanwhile)."""
        try:
            digest = copy_hashing(staged, dest, _CHUNK)
        except FileNotFoundError:
            return None
        expected = self._expected.get(path)
        if expected and digest != expected:
            for leftover in (staged, _side(staged, CLAIM)):
                _unlink(leftover)
            return None
        self.staged_copies += 1
        self._mark_taken(staged)
        return digest

    def _mark_taken(self, staged: Path) -> None:
        """This node's mark; the node whose mark completes the set deletes the staged copy. The
        marks are looked up by name (one ``stat`` per node), not by listing the folder, whose
        length grows with the shards staged and the nodes still to take them."""
        _side(staged, f"{TAKEN}{self.node}").touch()
        taken = [_side(staged, f"{TAKEN}{node}") for node in range(self.nodes)]
        if all(mark.exists() for mark in taken):  # every node has its copy: the staged one has done its work
            for leftover in (staged, _side(staged, CLAIM), *taken):
                _unlink(leftover)


def _side(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


