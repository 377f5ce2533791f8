"""The Hub client plumbing of ``sync`` and ``sync --watch``: the error every Hub failure becomes,
the client, and the calls that talk to the Hub.

The token policy, the client, the repository-id check and the scrubbing of messages are
``ds_trhash.hub_access``'s, the one policy of every Hub request of the project: ``HF_TOKEN`` from
the environment only, passed to ``HfApi`` explicitly so the library never falls back to a token
file; a client error is re-raised as ``SyncError`` without its original, token-bearing exception
chain (docs/contracts.md §9).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ds_trhash import hub_access
from ds_trhash.errors import UserError
from ds_trhash.hub_access import TOKEN_ENV, redact

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = ["TOKEN_ENV", "Log", "SyncError", "call_hub", "check_repo_id", "make_api", "probe_hub", "redact"]

Log = Callable[[str], None]
T = TypeVar("T")


class SyncError(UserError, RuntimeError):
    """A sync that did not complete; ``report`` says what was done before it stopped."""

    def __init__(self, message: str, report: object = None) -> None:  # report: release.hub.sync.SyncReport
        super().__init__(redact(message))
        self.report = report

    def message_lines(self) -> list[str]:
        """The first line, then the per-file differences when verification failed."""
        return str(self).splitlines() or [""]


def check_repo_id(repo_id: str) -> None:
    """A repository id the Hub accepts, before anything is read, locked or sent."""
    hub_access.check_repo_id(repo_id, "--repo-id", SyncError)


def make_api(*, require_token: bool = True) -> HfApi:
    """An ``HfApi`` authenticated by ``HF_TOKEN`` only (anonymous, never a token file, without it
    unless a token is required)."""
    return hub_access.make_api(SyncError, require_token=require_token, what="sync")


def call_hub(what: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)``; any failure but a ``SyncError`` becomes one that says ``what`` failed."""
    try:
        return fn(*args, **kwargs)
    except SyncError:
        raise
    except Exception as exc:  # network, auth, HTTP: reported without the original (token-bearing) chain
        raise SyncError(f"{what} failed: {type(exc).__name__}: {exc}") from None


def probe_hub(api: HfApi, repo_id: str, repo_type: str | None, revision: str | None = None,
              timeout: float = 10.0) -> None:
    """One request without retries, before a dry run reads the listings (which retry for about
    half a minute): an endpoint that does not answer fails the dry run at once, saying so; a
    repository that does not exist yet is an answer (everything would be uploaded)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        api.repo_info(repo_id, repo_type=repo_type, revision=revision or "main", timeout=timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return
    except Exception as exc:  # connection refused, timeout, HTTP error: reported without the chain
        raise SyncError(f"dry run: could not read {repo_id} on the Hub ({type(exc).__name__}: {exc}), so nothing is "
                        "reported as to upload: check HF_ENDPOINT, the network and HF_TOKEN") from None
