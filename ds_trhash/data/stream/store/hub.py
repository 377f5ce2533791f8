"""A corpus in a Hugging Face Hub dataset repository, read through ``huggingface_hub``.

The endpoint, the token and the reading of failures are ``ds_trhash.hub_access``'s (one policy for
every Hub request of the project: ``HF_TOKEN`` only, never printed or written). The revision is
resolved once to a commit and every later request names that commit, so a branch that moves during
(or after) a run changes nothing it reads.

Requests go through the client's own ``http_stream_backoff`` with its retries turned off: the
waiting is ``hub_access.Patience``'s (``Retry-After`` and rate limits honoured, capped backoff, a
wall-time budget of 30 minutes by default, one line per wait). A transfer that delivers no byte for
``HF_HUB_DOWNLOAD_TIMEOUT`` seconds is a transient failure, and the next attempt resumes with a
``Range`` request from the bytes already written. A shard is hashed as its bytes stream in, so the
cache never reads it back to verify it.
"""
from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional, TypeVar

# Loaded with this module, which only a Hub store imports: a prefetch process loads them as it starts,
# not at its first download, where a read waiting for that shard would pay for them
# (figures: docs/performance.md, "Shard streaming").
from huggingface_hub import constants, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import get_session, hf_raise_for_status, http_stream_backoff

from ds_trhash import hub_access
from ds_trhash.data.stream import deadline
from ds_trhash.data.stream.store.base import StoreError, StoreFile, StoreUnavailable, relative_name

T = TypeVar("T")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 1 << 20


class _CutShort(StoreUnavailable):
    """The body ended before the bytes the listing promised (transient: resumed by Range)."""


@dataclass
class _Transfer:
    """Where a download stands: bytes written to the sink, and their hash so far."""

    offset: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)


class HubStore:
    def __init__(self, repo_id: str, revision: str = "main", *, attempts: Optional[int] = None,
                 backoff_s: float = hub_access.BACKOFF_START_S, budget_s: float = hub_access.DEFAULT_BUDGET_S,
                 stall_s: Optional[float] = None, say: Optional[hub_access.Say] = None) -> None:
        self.repo_id, self.revision = repo_id, revision
        self.endpoint = hub_access.endpoint()
        self.patience = hub_access.Patience(budget_s=budget_s, attempts=attempts, backoff_s=backoff_s,
                                            say=say or hub_access.Patience.say)
        self.stall_s = float(stall_s if stall_s is not None else constants.HF_HUB_DOWNLOAD_TIMEOUT)
        self.commit: Optional[str] = None
        self.description = f"hf://datasets/{repo_id}@{revision} (endpoint {self.endpoint})"
        self.identity = f"hf:{self.endpoint}/datasets/{repo_id}"
        self._api = hub_access.make_api(StoreError)

    def __getstate__(self) -> dict[str, Any]:
        """What a download process needs (``fetcher``): the client is made again there, from the
        same environment (the token never travels)."""
        return {name: value for name, value in self.__dict__.items() if name != "_api"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._api = hub_access.make_api(StoreError)

    def warm_up(self) -> None:
        """The client's headers (built once per process: the client also looks up its agent
        registry then) and its HTTP session (an SSL context), made as a prefetch process starts
        rather than in its first download, while a read waits for that shard (figures:
        docs/performance.md, "Shard streaming")."""
        hub_access.headers()
        get_session()

    @property
    def attempts_made(self) -> int:
        """Requests sent, retries included (tests and the benchmark read it)."""
        return self.patience.requests

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        try:  # within what is left of the read's deadline, when a read set one
            return self.patience.call(what, call, budget_s=deadline.remaining())
        except hub_access.HubUnavailable as exc:
            raise StoreUnavailable(str(exc)) from None

    def _refusal(self, exc: BaseException, what: str) -> StoreError:
        return hub_access.refusal(exc, what, StoreError, f"hf://datasets/{self.repo_id}")

    # -- the store ---------------------------------------------------------------------
    def resolve(self, pinned: Optional[str] = None) -> str:
        wanted = pinned or self.revision
        try:
            info = self._retry(f"revision {wanted!r} of hf://datasets/{self.repo_id}",
                               lambda: self._api.dataset_info(self.repo_id, revision=wanted))
        except HfHubHTTPError as exc:
            raise self._refusal(exc, wanted) from None
        self.pin(str(info.sha))
        return str(info.sha)

    def head(self, revision: str) -> Optional[str]:
        """The commit ``revision`` names now, without pinning it (None if it names none any more)."""
        try:
            return str(self._retry(f"revision {revision!r} of hf://datasets/{self.repo_id}",
                                   lambda: self._api.dataset_info(self.repo_id, revision=revision)).sha)
        except HfHubHTTPError:
            return None

    def pin(self, commit: str) -> None:
        self.commit = commit
        self.description = f"hf://datasets/{self.repo_id}@{commit[:12]} (endpoint {self.endpoint})"

    def _pinned(self) -> str:
        if self.commit is None:
            raise AssertionError("HubStore.resolve() must run before the store is read")
        return self.commit

    def list_files(self) -> dict[str, StoreFile]:
        commit = self._pinned()

        def listing() -> list:
            return list(self._api.list_repo_tree(self.repo_id, repo_type="dataset", revision=commit, recursive=True))

        try:
            entries = self._retry(f"the file listing of hf://datasets/{self.repo_id}@{commit[:12]}", listing)
        except HfHubHTTPError as exc:
            raise self._refusal(exc, commit) from None
        found: dict[str, StoreFile] = {}
        for entry in entries:
            if getattr(entry, "size", None) is None:  # a folder
                continue
            lfs = getattr(entry, "lfs", None)
            found[entry.path] = StoreFile(entry.path, int(entry.size), getattr(lfs, "sha256", None))
        return found

    def _url(self, path: str) -> str:
        return hf_hub_url(self.repo_id, relative_name(path, f"hf://datasets/{self.repo_id}"), repo_type="dataset",
                          revision=self._pinned(), endpoint=self.endpoint)

    def _get_into(self, path: str, sink: BinaryIO, state: _Transfer, limit: int) -> None:
        """One GET, ranged from ``state["offset"]``: appends at most ``limit`` bytes in all, hashing
        them; ``state`` follows every block, so a cut transfer resumes from what was written."""
        request_headers = hub_access.headers()
        if state.offset:
            request_headers["Range"] = f"bytes={state.offset}-"
        with http_stream_backoff("GET", self._url(path), headers=request_headers, timeout=self.stall_s,
                                 follow_redirects=True, max_retries=0, retry_on_status_codes=(),
                                 retry_on_exceptions=()) as response:
            if response.status_code == 404:
                raise StoreError(f"{path} is not in hf://datasets/{self.repo_id}@{self._pinned()[:12]} "
                                 f"({self.endpoint}); the manifest names a file the revision lacks")
            hf_raise_for_status(response)
            if state.offset and response.status_code != 206:  # the server ignored the range: start over
                state.offset, state.digest = 0, hashlib.sha256()
            sink.seek(state.offset)
            for block in response.iter_bytes(_CHUNK):
                block = block[: max(0, limit - state.offset)]
                sink.write(block)
                state.digest.update(block)
                state.offset += len(block)

    def _fetch(self, path: str, sink: BinaryIO, limit: int, exact: bool) -> str:
        """Every byte of ``path`` into ``sink`` (waiting out outages, resuming by Range); its sha256."""
        state = _Transfer()

        def attempt() -> None:
            self._get_into(path, sink, state, limit)
            if exact and state.offset < limit:
                raise _CutShort(f"{path}: body ended at {state.offset} of {limit} bytes")

        try:
            self._retry(f"{path} (hf://datasets/{self.repo_id}@{self._pinned()[:12]})", attempt)
        except HfHubHTTPError as exc:
            raise self._refusal(exc, path) from None
        sink.truncate(state.offset)
        return state.digest.hexdigest()

    def read_json(self, path: str) -> object:
        buffer = io.BytesIO()
        self._fetch(path, buffer, 1 << 30, exact=False)
        try:
            return json.loads(buffer.getvalue().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"{path} in hf://datasets/{self.repo_id} is not valid UTF-8 JSON: {exc}") from None

    def download(self, path: str, dest: Path, size: int) -> str:
        """Into ``dest`` (preallocated): at most ``size`` bytes; a cut transfer resumes by Range.
        Returns the sha256 of the bytes written, computed as they arrived."""
        with open(dest, "r+b") as sink:
            return self._fetch(path, sink, size, exact=True)
