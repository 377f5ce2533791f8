"""The Hub client plumbing of ``sync`` and ``sync --watch``: the access token, the ``HfApi``
built from it, the error every Hub failure becomes, and the calls that talk to the Hub.

It exists so that one module alone knows where the token comes from (``HF_TOKEN`` in the
environment, passed to ``HfApi`` explicitly so the library never falls back to a token file)
and scrubs it from every message (``redact``): a client error is re-raised as ``SyncError``
without its original, token-bearing exception chain (docs/contracts.md §9).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ds_trhash.errors import UserError

if TYPE_CHECKING:
    from ds_trhash.release.hub import SyncReport

TOKEN_ENV = "HF_TOKEN"
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{8,}")

Log = Callable[[str], None]


class SyncError(UserError, RuntimeError):
    """A sync that did not complete; ``report`` says what was done before it stopped."""

    def __init__(self, message: str, report: "SyncReport | None" = None):
        super().__init__(redact(message))
        self.report = report

    def message_lines(self) -> list[str]:
        """The first line, then the per-file differences when verification failed."""
        return str(self).splitlines() or [""]


def redact(text: str) -> str:
    """Remove the access token (and anything shaped like a Hub token) from text."""
    token = os.environ.get(TOKEN_ENV)
    if token and len(token) >= 4:
        text = text.replace(token, "<redacted>")
    return _TOKEN_PATTERN.sub("hf_<redacted>", text)


def check_repo_id(repo_id: str) -> None:
    """A repository id the Hub accepts (``namespace/name`` of letters, digits, ``-_.``), before
    anything is read, locked or sent."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise SyncError(f"--repo-id {repo_id!r} is not a valid repository id ({' '.join(str(exc).split())[:200]}); "
                        "use namespace/name with letters, digits, '-', '_' and '.'") from None


def make_api(*, require_token: bool = True) -> Any:
    """An ``HfApi`` authenticated by ``HF_TOKEN`` only.

    Without the variable: an error when a token is required, else an anonymous client
    (``token=False``: never read from a token file).
    """
    from huggingface_hub import HfApi

    token = os.environ.get(TOKEN_ENV) or None
    if token is None and require_token:
        raise SyncError(f"{TOKEN_ENV} is not set: export it in the environment of this process (tokens are never "
                        "read from files, arguments or configs)")
    return HfApi(token=token if token is not None else False)


def call_hub(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; any failure but a ``SyncError`` becomes one that says ``what`` failed."""
    try:
        return fn(*args, **kwargs)
    except SyncError:
        raise
    except Exception as exc:  # network, auth, HTTP: reported without the original (token-bearing) chain
        raise SyncError(f"{what} failed: {type(exc).__name__}: {exc}") from None


def probe_hub(api: Any, repo_id: str, repo_type: str | None, revision: str | None = None,
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
