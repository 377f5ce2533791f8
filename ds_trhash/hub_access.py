"""The one way this project talks to the Hugging Face Hub: the token, the client, what a failure means.

Every Hub request of the package (the shard store, `data publish`, `sync`, `sync --watch`) goes
through ``huggingface_hub``'s own client and these few rules:

- **One token policy.** The token is ``HF_TOKEN`` from the environment, handed to the client
  explicitly; the client never falls back to a token file, so what a process can reach is what its
  environment says. The token travels in request headers only and is scrubbed (``redact``) from
  every message this project prints.
- **One repository-id check** (``check_repo_id``), by the client's own validator.
- **One reading of a failure** (``classify``): a refusal (no such repository or revision, no
  access, a bad request) is final and becomes the caller's ``UserError`` naming what to fix; a
  transient answer (HTTP 408, 429, 5xx, a network or protocol error) is worth waiting for.
- **Outages waited out** (``Patience.call``): transient failures are retried with capped
  exponential backoff, honouring ``Retry-After`` and the Hub's rate-limit headers, for up to a time
  budget (30 minutes by default), with one visible line per wait; only then does the caller get
  ``HubUnavailable``.

Imports nothing of ours but the error base; huggingface_hub is imported when first needed, so a
command that never reaches the Hub does not pay for it.
"""
from __future__ import annotations

import email.utils
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from ds_trhash.errors import UserError

if TYPE_CHECKING:
    from huggingface_hub import HfApi

TOKEN_ENV = "HF_TOKEN"
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{8,}")
DEFAULT_BUDGET_S = 30 * 60.0  # how long an outage is waited out before a request gives up
BACKOFF_START_S, BACKOFF_CAP_S = 1.0, 60.0
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# The HTTP client's transport failures (connection refused or reset, timeouts, a body cut short),
# recognised by class name so that no module of ours imports the client; a malformed URL is a bug.
_TRANSPORT = frozenset({"TransportError"})
_NOT_TRANSIENT = frozenset({"UnsupportedProtocol", "LocalProtocolError"})
T = TypeVar("T")
E = TypeVar("E", bound=UserError)
Say = Callable[[str], None]


class HubUnavailable(UserError, ConnectionError):
    """A transient failure outlived the wait budget (or the attempts a caller allows)."""


def redact(text: str) -> str:
    """Remove the access token (and anything shaped like a Hub token) from text."""
    token = os.environ.get(TOKEN_ENV)
    if token and len(token) >= 4:
        text = text.replace(token, "<redacted>")
    return _TOKEN_PATTERN.sub("hf_<redacted>", text)


def token() -> Optional[str]:
    """``HF_TOKEN`` from the environment, or None (anonymous)."""
    return os.environ.get(TOKEN_ENV) or None


def token_or_false() -> str | bool:
    """What to pass as ``token=`` to the client: the token, or False (never read a token file)."""
    return token() or False


def endpoint() -> str:
    """``HF_ENDPOINT``, else the public Hub."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def make_api(error: type[UserError], *, require_token: bool = False, what: str = "this command") -> HfApi:
    """An ``HfApi`` on ``endpoint()`` authenticated by ``HF_TOKEN`` only; without the variable an
    ``error`` when a token is required, else an anonymous client."""
    from huggingface_hub import HfApi

    if token() is None and require_token:
        raise error(f"{TOKEN_ENV} is not set: {what} needs a Hub access token with write access; export "
                    f"{TOKEN_ENV}=hf_... in this shell (tokens are never read from files, arguments or configs)")
    return HfApi(endpoint=endpoint(), token=token_or_false())


def headers() -> dict[str, str]:
    """The client's own request headers (user agent, and the token when there is one)."""
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=token_or_false())


def repo_id_problem(repo_id: object) -> Optional[str]:
    """What is wrong with a repository id (``namespace/name`` of letters, digits, ``-_.``, by the
    client's own validator), or None: the one check of every id a command or a plan names."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(repo_id, str):
        return f"a repository id is text, not {type(repo_id).__name__}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return f"{' '.join(str(exc).split())[:200]}; use namespace/name with letters, digits, '-', '_' and '.'"
    if repo_id.count("/") != 1:
        return "give namespace/name, so nothing lands in another namespace"
    return None


def check_repo_id(repo_id: str, option: str, error: type[UserError]) -> str:
    """``repo_id`` if the Hub accepts it, before anything is read, locked or sent; else ``error``
    naming the option (or field) that gave it."""
    problem = repo_id_problem(repo_id)
    if problem:
        raise error(f"{option} {repo_id!r} is not a valid repository id ({problem})")
    return repo_id


# ----------------------------------------------------------------------------- what a failure means


def status_of(exc: BaseException) -> Optional[int]:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Worth waiting for: the network or an overloaded Hub, not a refusal."""
    status = status_of(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _NOT_TRANSIENT:
        return False
    return bool(names & _TRANSPORT) or isinstance(exc, (ConnectionError, TimeoutError))


def server_delay(exc: BaseException) -> Optional[float]:
    """Seconds the Hub asked us to wait: its rate-limit reset on a 429 with nothing left, else
    ``Retry-After`` (seconds or an HTTP date); None when it said nothing."""
    response = getattr(exc, "response", None)
    found: Mapping[str, str] = getattr(response, "headers", None) or {}
    if status_of(exc) == 429:
        from huggingface_hub.utils import parse_ratelimit_headers

        limit = parse_ratelimit_headers(found)
        if limit is not None and limit.remaining == 0:
            return float(limit.reset_in_seconds)
    value = next((v for k, v in found.items() if k.lower() == "retry-after"), None)
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def reason(exc: BaseException) -> str:
    status = status_of(exc)
    return f"HTTP {status}" if status else type(exc).__name__


def refusal(exc: BaseException, what: str, error: type[E], repo: str = "") -> E:
    """A final Hub answer as the caller's ``error``, naming what to fix (the token never in it)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    where = f" at {endpoint()}"
    if isinstance(exc, RevisionNotFoundError):
        return error(redact(f"{repo or 'the repository'} has no revision {what!r}{where}"))
    if isinstance(exc, RepositoryNotFoundError):
        return error(redact(f"repository {repo} not found{where} (a private repository needs {TOKEN_ENV} with "
                            "access to it)"))
    detail = " ".join(str(exc).split())[:600]
    said = f"{reason(exc)}: {detail}" if detail and detail != reason(exc) else reason(exc)
    if status_of(exc) in (401, 403):
        return error(redact(f"the Hub{where} refused {what} ({said}): set {TOKEN_ENV} to a token with "
                            f"access to {repo or 'the repository'}"))
    return error(redact(f"the Hub{where} refused {what}{' of ' + repo if repo else ''} ({said})"))


def failure(exc: BaseException, what: str, error: type[UserError], repo: str = "", transient_hint: str = "") -> UserError:
    """Any failure of one client call as the caller's ``error``: a transient one says it may pass
    (``transient_hint``: what to do then), a refusal what to fix."""
    if is_transient(exc):
        detail = " ".join(str(exc).split())[:600]
        return error(redact(f"{what} failed ({reason(exc)}{': ' + detail if detail else ''}); the Hub or the "
                            f"network failed{': ' + transient_hint if transient_hint else ''}"))
    return refusal(exc, what, error, repo)


# ----------------------------------------------------------------------------- waiting out an outage


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    minutes, sec = divmod(seconds, 60)
    return f"{minutes} m {sec} s" if minutes and sec else (f"{minutes} m" if minutes else f"{sec} s")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass
class Patience:
    """How long a caller waits out transient failures: ``budget_s`` of wall time, and optionally at
    most ``attempts`` tries; backoff starts at ``backoff_s`` and doubles up to ``cap_s`` (a server's
    own ``Retry-After`` wins, within the budget). ``say`` gets one line per wait."""

    budget_s: float = DEFAULT_BUDGET_S
    attempts: Optional[int] = None
    backoff_s: float = BACKOFF_START_S
    cap_s: float = BACKOFF_CAP_S
    say: Say = _stderr
    sleep: Callable[[float], None] = time.sleep
    requests: int = 0  # attempts made, retries included (tests and the benchmark read it)
    waits: int = 0

    def call(self, what: str, fn: Callable[[], T], budget_s: Optional[float] = None) -> T:
        """``fn()``, retried while it fails transiently and the budget lasts; a refusal is raised as
        it is, an outage that outlives the budget as ``HubUnavailable`` naming ``what``.
        ``budget_s``: this call's budget when it is less than ``self.budget_s`` (what is left of
        a read's deadline)."""
        start, delay, tries, slept = time.monotonic(), self.backoff_s, 0, 0.0
        budget = self.budget_s if budget_s is None else min(self.budget_s, budget_s)
        while True:
            tries += 1
            self.requests += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 (classified right below)
                if not is_transient(exc):
                    raise
                waited = max(time.monotonic() - start, slept)
                wait = min(server_delay(exc) or delay, self.cap_s * 5)
                if (self.attempts is not None and tries >= self.attempts) or waited + wait > budget:
                    raise HubUnavailable(redact(
                        f"cannot get {what} from the Hub at {endpoint()} after {tries} attempts over "
                        f"{_clock(waited)} (last: {reason(exc)}); check the network, HF_ENDPOINT, or relaunch "
                        "later")) from None
                self.waits += 1
                self.say(f"Hub answers {reason(exc)} for {what}; retrying in {_clock(wait)}, waited "
                         f"{_clock(waited)} of {_clock(budget)}")
                self.sleep(wait)
                slept += wait
                delay = min(delay * 2, self.cap_s)
