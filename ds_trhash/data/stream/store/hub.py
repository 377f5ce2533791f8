"""A corpus in a Hugging Face Hub dataset repository, read through ``huggingface_hub``.

The endpoint is ``HF_ENDPOINT`` (else the public Hub); the token is whatever the client finds
(``HF_TOKEN`` or a saved login). It travels in request headers only: no message, log or file
written here ever holds it. The revision is resolved once to a commit and every later request
names that commit, so a branch that moves during (or after) a run changes nothing it reads.

Transient failures (connection refused or reset, DNS failure, timeouts, a body cut short,
HTTP 429 and 5xx) are retried with exponential backoff a bounded number of times; a transfer
that delivers no byte for ``HF_HUB_DOWNLOAD_TIMEOUT`` seconds is such a timeout, and the next
attempt resumes with a ``Range`` request from the bytes already written.
"""
from __future__ import annotations

import io
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import httpx2
from huggingface_hub import HfApi, constants, get_session, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import build_hf_headers

from ds_trhash.data.stream.store.base import StoreError, StoreFile, StoreUnavailable, relative_name

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 1 << 20
T = TypeVar("T")


def _status(exc: BaseException) -> Optional[int]:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_transient(exc: BaseException) -> bool:
    """Worth another attempt: the network or an overloaded server, not a refusal."""
    if isinstance(exc, (httpx2.TransportError, ConnectionError, TimeoutError)):
        return True
    status = _status(exc)
    return status is not None and (status == 429 or status >= 500)


class HubStore:
    def __init__(self, repo_id: str, revision: str = "main", *, attempts: int = 5, backoff_s: float = 0.5,
                 stall_s: Optional[float] = None) -> None:
        self.repo_id, self.revision = repo_id, revision
        self.endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
        self.attempts, self.backoff_s = max(1, attempts), backoff_s
        self.stall_s = float(stall_s if stall_s is not None else constants.HF_HUB_DOWNLOAD_TIMEOUT)
        self.commit: Optional[str] = None
        self.description = f"hf://datasets/{repo_id}@{revision} (endpoint {self.endpoint})"
        self.identity = f"hf:{self.endpoint}/datasets/{repo_id}"
        self._api = HfApi(endpoint=self.endpoint)
        self.attempts_made = 0  # requests sent, retries included (tests and the benchmark read it)

    # -- retries -----------------------------------------------------------------------
    def _retry(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(1, self.attempts + 1):
            self.attempts_made += 1
            try:
                return call()
            except BaseException as exc:  # noqa: BLE001 (classified right below)
                if not is_transient(exc):
                    raise
                if attempt == self.attempts:
                    reason = f"HTTP {_status(exc)}" if _status(exc) else type(exc).__name__
                    raise StoreUnavailable(
                        f"cannot get {what} from the Hub at {self.endpoint} after {self.attempts} attempts "
                        f"(last: {reason}); check the network, HF_ENDPOINT, or retry later") from None
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 8.0))
        raise AssertionError("unreachable")

    def _refusal(self, exc: BaseException, what: str) -> StoreError:
        if isinstance(exc, RevisionNotFoundError):
            return StoreError(f"hf://datasets/{self.repo_id} has no revision {what!r} at {self.endpoint}")
        if isinstance(exc, RepositoryNotFoundError):
            return StoreError(f"dataset repository {self.repo_id} not found at {self.endpoint} "
                              "(a private repository needs HF_TOKEN or `hf auth login`)")
        return StoreError(f"the Hub at {self.endpoint} refused {what} of hf://datasets/{self.repo_id}: "
                          f"HTTP {_status(exc)}")

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

    def _get_into(self, path: str, sink, start: int, limit: int) -> int:
        """One GET (ranged from ``start``): appends at most ``limit - start`` bytes; returns the new offset."""
        headers = build_hf_headers()
        if start:
            headers["Range"] = f"bytes={start}-"
        timeout = httpx2.Timeout(self.stall_s, connect=self.stall_s)
        with get_session().stream("GET", self._url(path), headers=headers, timeout=timeout,
                                  follow_redirects=True) as response:
            if response.status_code == 404:
                raise StoreError(f"{path} is not in hf://datasets/{self.repo_id}@{self._pinned()[:12]} "
                                 f"({self.endpoint}); the manifest names a file the revision lacks")
            if start and response.status_code != 206:
                start = 0  # the server ignored the range: start over
                sink.seek(0)
            response.raise_for_status()
            offset = start
            for block in response.iter_bytes(_CHUNK):
                block = block[: max(0, limit - offset)]
                sink.write(block)
                offset += len(block)
            return offset

    def read_json(self, path: str) -> Any:
        buffer = io.BytesIO()
        state = {"offset": 0}

        def fetch() -> int:
            state["offset"] = self._get_into(path, buffer, state["offset"], 1 << 30)
            return state["offset"]

        try:
            self._retry(f"{path} (hf://datasets/{self.repo_id})", fetch)
        except HfHubHTTPError as exc:
            raise self._refusal(exc, path) from None
        except httpx2.HTTPStatusError as exc:
            raise self._refusal(exc, path) from None
        try:
            return json.loads(buffer.getvalue().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"{path} in hf://datasets/{self.repo_id} is not valid UTF-8 JSON: {exc}") from None

    def download(self, path: str, dest: Path, size: int) -> None:
        """Into ``dest`` (preallocated): at most ``size`` bytes; a cut transfer resumes by Range."""
        with open(dest, "r+b") as sink:
            state = {"offset": 0}

            def fetch() -> int:
                sink.seek(state["offset"])
                try:
                    state["offset"] = self._get_into(path, sink, state["offset"], size)
                finally:
                    state["offset"] = sink.tell()
                if state["offset"] < size:
                    raise httpx2.RemoteProtocolError(f"{path}: body ended at {state['offset']} of {size} bytes")
                return state["offset"]

            try:
                self._retry(f"{path} (hf://datasets/{self.repo_id}@{self._pinned()[:12]})", fetch)
            except httpx2.HTTPStatusError as exc:
                raise self._refusal(exc, path) from None
            sink.truncate(state["offset"])
