"""The token and the Hub client of a sync (release/hub/client.py): the token from the
environment only and never shown, an invalid repository id refused before anything, an endpoint
that does not answer failing a dry run at once."""
import time

import pytest
from huggingface_hub import constants

from ds_trhash import cli as commands
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub.sync import SyncError, sync
from tests.release.conftest import TOKEN
from tests.release.hub_fixtures import REPO, make_run, tree_digest

def test_make_api_takes_the_token_from_the_environment_only(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SyncError, match="HF_TOKEN is not set"):
        hub.make_api()
    assert hub.make_api(require_token=False).token is False  # anonymous, never a token file
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert hub.make_api().token == TOKEN


def test_a_rejected_token_is_never_shown_and_a_token_argument_is_refused(tmp_path, server, monkeypatch, capsys):
    out = make_run(tmp_path)
    wrong = "hf_WRONGtoken0123456789abcdefgh"  # the server echoes the rejected Authorization header
    monkeypatch.setenv("HF_TOKEN", wrong)
    before = tree_digest(out)
    lines = []
    with pytest.raises(SyncError, match="401") as info:
        sync(out, REPO, hub.make_api(), log=lines.append)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert all(wrong not in text for text in [str(info.value), info.value.report.error or "", *lines])
    assert commands.main(["sync", "--local", str(out), "--repo-id", REPO, "--prune-local"]) == 2
    captured = capsys.readouterr()
    assert "401" in captured.err and wrong not in captured.err + captured.out and tree_digest(out) == before

    with pytest.raises(SystemExit) as exit_info:
        commands.main(["sync", "--local", str(tmp_path), "--repo-id", REPO, "--token", TOKEN])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "HF_TOKEN" in captured.err and TOKEN not in captured.err + captured.out


def test_sync_refuses_an_invalid_repo_id_before_anything(tmp_path, server, capsys):
    out = make_run(tmp_path)
    before = tree_digest(out)
    assert commands.main(["sync", "--local", str(out), "--repo-id", "not a valid id!!", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--repo-id 'not a valid id!!' is not a valid repository id" in err and "Traceback" not in err
    assert server.requests == [] or "commit" not in server.requests
    assert tree_digest(out) == before


def test_a_dry_run_against_an_endpoint_that_does_not_answer_fails_fast_and_says_so(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = make_run(tmp_path)
    before = tree_digest(out)
    started = time.monotonic()
    assert commands.main(["sync", "--local", str(out), "--repo-id", REPO, "--dry-run"]) == 2
    assert time.monotonic() - started < 10  # one request, not the listing's half minute of retries
    err = capsys.readouterr().err
    assert "dry run:" in err and f"could not read {REPO} on the Hub" in err and "would upload" not in err, err
    assert tree_digest(out) == before
