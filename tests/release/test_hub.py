"""Hub sync through the real ``huggingface_hub`` client against a stand-in Hub on loopback
(tests/release/hub_server.py): uploads, remote hash verification, a dropped upload, retry, and
the ``--prune-local`` rules, and the trainer's rotation beside a sync (lock, ``keep_unsynced``)."""
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, constants

from ds_trhash.checkpoints import MANIFEST, list_checkpoints, rotate_unless_syncing, save_checkpoint
from ds_trhash.checkpoints.sync_guard import LOCK_FILE, VERIFIED_FILE, read_verified
from ds_trhash.io import sha256_file
from ds_trhash import cli as commands
from ds_trhash.release import hub
from ds_trhash.release.hub import SyncError, sync, sync_lock

from tests.release.conftest import TOKEN
REPO = "me/run"
UNITS = ["checkpoints/step_00000010", "checkpoints/step_00000020", "checkpoints/step_00000030", "export"]


def _state(step):
    return dict(stage="pretraining", step=step, epoch=0, data_cursor=0, world_size=1, training_critical={},
                plan_fingerprint=None, plan_sha256=None, backends_used={"experts": "pytorch"}, lora=False,
                family="language")


def _engine(payload):
    def write(tmp):
        (tmp / "state").mkdir()
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(payload)
    return write


def _run(tmp_path, steps=(10, 20, 30)):
    """A run directory: three complete checkpoints (an LFS-tracked .pt, regular JSON) and an export."""
    out = tmp_path / "run"
    for step in steps:
        save_checkpoint(out, step, write_engine_state=_engine(b"weights-%d" % step * 50), trainer_state=_state(step),
                        rank=0, world_size=1)
    exp = out / "export"
    exp.mkdir()
    (exp / "model.safetensors").write_bytes(b"final weights" * 40)
    (exp / "config.json").write_text("{}")
    entry = lambda p: {"sha256": sha256_file(p), "size": p.stat().st_size}  # noqa: E731
    (exp / "export_manifest.json").write_text(json.dumps({
        "format": "ds-trhash-export-v1", "weights": {"file": "model.safetensors", **entry(exp / "model.safetensors")},
        "files": {"config.json": entry(exp / "config.json")}}))
    return out


def _steps(out):
    return [c.step for c in list_checkpoints(out)]


def _tree_digest(root: Path) -> str:
    """Every checkpoint and export byte (the sync's own lock and verified record aside)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (LOCK_FILE, VERIFIED_FILE)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _quiet(line):
    pass


def _assert_remote_equals_local(srv, out, unit):
    remote = {p[len(unit) + 1:]: f for p, f in srv.repo(REPO).files.items() if p.startswith(unit + "/")}
    local = {p.relative_to(out / unit).as_posix(): p.read_bytes() for p in (out / unit).rglob("*") if p.is_file()}
    assert {k: f.data for k, f in remote.items()} == local
    assert {k for k, f in remote.items() if f.lfs} == {k for k in local if k.endswith((".pt", ".safetensors"))}


def test_upload_verify_then_prune_and_a_second_pass_uploads_nothing(tmp_path, server):
    out = _run(tmp_path)
    watched = [out / u for u in UNITS]
    # nothing local is deleted while the Hub is still being talked to about it
    server.observers.append(lambda name: all(p.is_dir() for p in watched) or pytest.fail(f"deleted during {name}"))
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert report.uploaded == UNITS and report.verified == UNITS
    assert report.pruned == UNITS[:2] and report.kept == [UNITS[2]]
    assert _steps(out) == [30] and (out / "export" / "model.safetensors").is_file()
    # what rotation (checkpoint.keep_unsynced), cleanup and the watcher read: the verified units still on disk
    assert read_verified(out) == {UNITS[2]: {"manifest_sha256": sha256_file(out / UNITS[2] / MANIFEST),
                                             "repo_id": REPO},
                                  UNITS[3]: {"manifest_sha256": sha256_file(out / UNITS[3] / "export_manifest.json"),
                                             "repo_id": REPO}}
    repo = server.repo(REPO)
    assert repo.private and len(repo.commits) == 4  # created private, one commit per unit
    for unit in UNITS[2:]:
        _assert_remote_equals_local(server, out, unit)
    assert not any(LOCK_FILE in p for p in repo.files)
    # the LFS objects went through the batch API and one pre-signed PUT each, then were committed by oid
    assert server.counts["lfs_upload"] == server.counts["lfs_verify"] == len(server.lfs_store) >= 4
    server.observers.clear()

    again = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert again.uploaded == [] and again.already_remote == UNITS[2:] and again.pruned == []
    assert len(repo.commits) == 4


@pytest.mark.parametrize("bad", ["checkpoints/step_00000020/state/mp_rank_00_model_states.pt",  # LFS: SHA-256
                                 "checkpoints/step_00000020/trainer_state.json"])  # regular: git blob id
def test_a_remote_hash_mismatch_stops_the_sync_and_prunes_nothing(tmp_path, server, bad):
    out = _run(tmp_path)
    server.corrupt.add(bad)
    before = _tree_digest(out)
    with pytest.raises(SyncError, match="does not verify") as info:
        sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert bad in str(info.value)
    assert info.value.report.pruned == [] and info.value.report.verified == [UNITS[0]]
    assert _tree_digest(out) == before and list(read_verified(out)) == [UNITS[0]]
    # the trainer's rotation with checkpoint.keep_unsynced deletes what this sync verified, nothing else
    removed = rotate_unless_syncing(out, keep_last=1, keep_unsynced=True, log=_quiet)
    assert [p.name for p in removed] == ["step_00000010"] and _steps(out) == [20, 30]


def test_a_dropped_upload_prunes_nothing_and_the_next_pass_completes(tmp_path, server):
    out = _run(tmp_path)
    before = _tree_digest(out)
    server.drop["commit"] = {2}  # the second unit's commit: connection closed half-way through the body
    with pytest.raises(SyncError, match=f"uploading {UNITS[1]} to {REPO} failed") as info:
        sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert info.value.report.verified == [UNITS[0]] and info.value.report.pruned == []
    assert _tree_digest(out) == before and _steps(out) == [10, 20, 30] and list(read_verified(out)) == [UNITS[0]]
    assert not any(p.startswith(UNITS[1]) for p in server.repo(REPO).files)  # a commit is all or nothing
    assert set(server.lfs_store) >= {sha256_file(out / UNITS[1] / "state" / "mp_rank_00_model_states.pt")}

    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert report.already_remote == [UNITS[0]] and report.uploaded == UNITS[1:]
    assert report.pruned == UNITS[:2] and _steps(out) == [30] and list(read_verified(out)) == UNITS[2:]
    # step 20's weights reached the LFS store before the drop; the retry commits them without a new PUT
    assert server.counts["lfs_upload"] == len(server.lfs_store)


def test_stale_files_in_a_checkpoint_folder_on_the_hub_are_deleted(tmp_path, server):
    out = _run(tmp_path, steps=(10,))
    api = hub.make_api()
    api.create_repo(REPO, private=True)
    stale = f"{UNITS[0]}/state/mp_rank_01_model_states.pt"  # from an earlier two-rank run
    api.create_commit(REPO, [CommitOperationAdd(stale, b"old shard")], commit_message="earlier run")
    assert f"{stale}: on the Hub but not in the local manifest" in hub.remote_differences(
        api, REPO, hub.discover(out).units[0])
    report = sync(out, REPO, api, log=_quiet)
    assert report.verified == [UNITS[0], "export"]
    assert stale not in server.repo(REPO).files
    _assert_remote_equals_local(server, out, UNITS[0])


def test_incomplete_checkpoint_is_neither_uploaded_nor_pruned(tmp_path, server):
    out = _run(tmp_path)
    (out / UNITS[1] / MANIFEST).unlink()
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=_quiet)
    assert UNITS[1] in report.skipped
    assert not any(p.startswith(UNITS[1] + "/") for p in server.repo(REPO).files)
    assert _steps(out) == [20, 30]  # step 10 verified and pruned; step 20 left for a person
    with pytest.raises(SyncError, match="only complete checkpoints"):
        sync(out / UNITS[1], REPO, hub.make_api(), log=_quiet)


def test_a_held_lock_fails_fast_before_any_request_and_waits_when_allowed(tmp_path, server):
    out = _run(tmp_path)
    with sync_lock(out):
        start = time.monotonic()
        with pytest.raises(SyncError, match="held by another sync"):
            sync(out, REPO, hub.make_api(), prune_local=True, log=_quiet)
        assert time.monotonic() - start < 2.0
        with pytest.raises(SyncError, match="held by another sync"):  # one checkpoint of the run: same lock
            sync(out / UNITS[0], REPO, hub.make_api(), log=_quiet)
    assert server.requests == [] and _steps(out) == [10, 20, 30]

    held = threading.Event()

    def holder():
        with sync_lock(out):
            held.set()
            time.sleep(0.3)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    report = sync(out, REPO, hub.make_api(), lock_timeout=5.0, log=_quiet)
    thread.join()
    assert report.verified == UNITS


def test_dry_run_creates_uploads_and_deletes_nothing(tmp_path, server):
    out = _run(tmp_path)
    before = _tree_digest(out)
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=2, dry_run=True, log=_quiet)
    assert report.would_upload == UNITS and report.would_prune == [UNITS[0]]
    assert server.repos == {} and "commit" not in server.requests and _tree_digest(out) == before


def test_a_single_export_goes_to_the_repo_root_and_prune_needs_the_run_dir(tmp_path, server):
    out = _run(tmp_path)
    report = sync(out / "export", "me/model", hub.make_api(), log=_quiet)
    assert report.verified == ["export"]
    assert set(server.repo("me/model").files) == {"model.safetensors", "config.json", "export_manifest.json"}
    with pytest.raises(SyncError, match="needs the run output directory"):
        sync(out / "export", "me/model", hub.make_api(), prune_local=True, log=_quiet)
    with pytest.raises(SyncError, match="keep_last"):
        sync(out, "me/model", hub.make_api(), prune_local=True, keep_last=0, log=_quiet)


def test_make_api_takes_the_token_from_the_environment_only(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SyncError, match="HF_TOKEN is not set"):
        hub.make_api()
    assert hub.make_api(require_token=False).token is False  # anonymous, never a token file
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert hub.make_api().token == TOKEN


def test_cli_sync_over_http_while_the_trainers_rotation_waits_for_it(tmp_path, server):
    """A real `ds-trhash sync` process, held by the server in its first commit, has the output
    directory's lock: the trainer's rotation deletes nothing meanwhile, and catches up after."""
    out = _run(tmp_path)
    server.arrived["commit"] = threading.Event()
    gate = server.hold["commit"] = threading.Event()
    env = {**os.environ, "HF_ENDPOINT": server.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ds_trhash.cli", "sync", "--local", str(out), "--repo-id", REPO,
                             "--prune-local", "--keep-last", "2"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert server.arrived["commit"].wait(120), "the sync never reached its first commit"
        lines = []
        assert rotate_unless_syncing(out, keep_last=1, log=lines.append) is None
        assert _steps(out) == [10, 20, 30] and "rotation deferred" in lines[0]
    finally:
        gate.set()
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "pruned 1" in stdout and _steps(out) == [20, 30]
    removed = rotate_unless_syncing(out, keep_last=1, keep_unsynced=True, log=_quiet)
    assert [p.name for p in removed] == ["step_00000020"] and _steps(out) == [30]  # verified, so it may go


def test_a_rejected_token_is_never_shown_and_a_token_argument_is_refused(tmp_path, server, monkeypatch, capsys):
    out = _run(tmp_path)
    wrong = "hf_WRONGtoken0123456789abcdefgh"  # the server echoes the rejected Authorization header
    monkeypatch.setenv("HF_TOKEN", wrong)
    before = _tree_digest(out)
    lines = []
    with pytest.raises(SyncError, match="401") as info:
        sync(out, REPO, hub.make_api(), log=lines.append)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert all(wrong not in text for text in [str(info.value), info.value.report.error or "", *lines])
    assert commands.main(["sync", "--local", str(out), "--repo-id", REPO, "--prune-local"]) == 2
    captured = capsys.readouterr()
    assert "401" in captured.err and wrong not in captured.err + captured.out and _tree_digest(out) == before

    with pytest.raises(SystemExit) as exit_info:
        commands.main(["sync", "--local", str(tmp_path), "--repo-id", REPO, "--token", TOKEN])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "HF_TOKEN" in captured.err and TOKEN not in captured.err + captured.out


def test_sync_refuses_an_invalid_repo_id_before_anything(tmp_path, server, capsys):
    out = _run(tmp_path)
    before = _tree_digest(out)
    assert commands.main(["sync", "--local", str(out), "--repo-id", "not a valid id!!", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--repo-id 'not a valid id!!' is not a valid repository id" in err and "Traceback" not in err
    assert server.requests == [] or "commit" not in server.requests
    assert _tree_digest(out) == before


def test_a_dry_run_against_an_endpoint_that_does_not_answer_fails_fast_and_says_so(tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = _run(tmp_path)
    before = _tree_digest(out)
    started = time.monotonic()
    assert commands.main(["sync", "--local", str(out), "--repo-id", REPO, "--dry-run"]) == 2
    assert time.monotonic() - started < 10  # one request, not the listing's half minute of retries
    err = capsys.readouterr().err
    assert "dry run:" in err and f"could not read {REPO} on the Hub" in err and "would upload" not in err, err
    assert _tree_digest(out) == before
