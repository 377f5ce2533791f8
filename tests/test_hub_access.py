"""The one Hub policy: failures classified, waits reported and bounded, tokens never shown."""
import pytest

from ds_trhash import hub_access
from ds_trhash.errors import UserError


class _Response:
    def __init__(self, status, headers=None):
        self.status_code, self.headers = status, headers or {}


class _Failure(Exception):
    def __init__(self, status, headers=None):
        super().__init__(f"HTTP {status}")
        self.response = _Response(status, headers)


class TransportError(Exception):
    """Named like the HTTP client's transport failures (classified by class name)."""


class UnsupportedProtocol(TransportError):
    pass


@pytest.mark.parametrize("exc, transient", [
    (_Failure(503), True), (_Failure(429), True), (_Failure(408), True), (_Failure(500), True),
    (_Failure(404), False), (_Failure(401), False), (_Failure(400), False),
    (TransportError(), True), (UnsupportedProtocol(), False), (ConnectionResetError(), True),
    (TimeoutError(), True), (ValueError(), False),
])
def test_what_is_worth_waiting_for(exc, transient):
    assert hub_access.is_transient(exc) is transient


def test_the_server_says_how_long_to_wait():
    assert hub_access.server_delay(_Failure(503, {"Retry-After": "20"})) == 20.0
    assert hub_access.server_delay(_Failure(429, {"ratelimit": '"api";r=0;t=55'})) == 55.0
    assert hub_access.server_delay(_Failure(429, {"ratelimit": '"api";r=3;t=55', "retry-after": "2"})) == 2.0
    assert hub_access.server_delay(_Failure(503)) is None


def test_waits_are_reported_capped_and_bounded_by_the_budget():
    lines, sleeps, calls = [], [], []

    def flaky():
        calls.append(1)
        raise _Failure(503, {"Retry-After": "20"} if len(calls) == 3 else {})

    patience = hub_access.Patience(budget_s=100, backoff_s=10, cap_s=30, say=lines.append, sleep=sleeps.append)
    with pytest.raises(hub_access.HubUnavailable, match=r"cannot get shard.bin from the Hub at .* after \d+ attempts "
                                                       r"over 1 m \d+ s \(last: HTTP 503\)"):
        patience.call("shard.bin", flaky)
    assert sleeps[:4] == [10, 20, 20, 30]  # doubling, the server's Retry-After once, capped at 30
    assert lines[0] == "Hub answers HTTP 503 for shard.bin; retrying in 10 s, waited 0 s of 1 m 40 s"
    assert isinstance(hub_access.HubUnavailable("x"), UserError)


def test_a_calls_own_budget_caps_the_patience_budget():
    """A read's deadline leaves a download less than the store's budget: its waits end there."""
    lines, sleeps = [], []

    def down():
        raise _Failure(503)

    patience = hub_access.Patience(budget_s=100, backoff_s=10, cap_s=30, say=lines.append, sleep=sleeps.append)
    with pytest.raises(hub_access.HubUnavailable, match=r"after 3 attempts over 30 s \(last: HTTP 503\)"):
        patience.call("shard.bin", down, budget_s=35)
    assert sleeps == [10, 20] and lines[0].endswith("waited 0 s of 35 s")


def test_a_refusal_is_not_retried():
    calls = []

    def refused():
        calls.append(1)
        raise _Failure(404)

    with pytest.raises(_Failure):
        hub_access.Patience(say=lambda line: None, sleep=lambda s: None).call("x", refused)
    assert calls == [1]


def test_the_token_never_reaches_a_message(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETSECRET123")
    err = hub_access.refusal(_Failure(401), "the listing", UserError, "acme/x")
    assert "SECRET" not in str(err) and "set HF_TOKEN" in str(err)
    assert hub_access.redact("Bearer hf_SECRETSECRET123 and hf_otherTOKEN9999") == "Bearer <redacted> and hf_<redacted>"


def test_one_repo_id_check():
    assert hub_access.check_repo_id("acme/corpus", "--repo", UserError) == "acme/corpus"
    for bad in ("acme", "a/b/c", "acme/x y", "../x"):
        with pytest.raises(UserError, match=f"--repo {bad!r} is not a valid repository id"):
            hub_access.check_repo_id(bad, "--repo", UserError)
