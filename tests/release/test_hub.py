"""Hub sync against a local fake of the HfApi methods it uses (create_commit, get_paths_info)."""
import hashlib
import logging
import threading
import time

import pytest
from huggingface_hub.hf_api import RepoFile

from ds_trhash.release import commands, hub
from ds_trhash.release.hub import SyncError, sync, sync_lock
from ds_trhash.checkpoints import MANIFEST, list_checkpoints, save_checkpoint

TOKEN = "hf_FAKEtokenVALUE0123456789abcd"


class FakeHub:
    """An in-memory repository answering like the Hub: LFS files report their SHA-256, regular
    files their git blob id. ``corrupt`` names remote paths whose stored bytes get one bit
    flipped; ``fail_commit`` makes commits raise ``fail_commit`` (an exception)."""

    LFS_SUFFIXES = (".pt", ".safetensors")

    def __init__(self, watch=None):
        self.files: dict[str, bytes] = {}
        self.commits: list[list[str]] = []
        self.calls: list[str] = []
        self.corrupt: set[str] = set()
        self.fail_commit: Exception | None = None
        self.watch = watch or []  # local dirs that must exist whenever the Hub is touched

    def _touch(self, name):
        self.calls.append(name)
        for path in self.watch:
            assert path.exists(), f"{path} was deleted while the Hub was still in use ({name})"

    def create_commit(self, repo_id, operations, *, commit_message, repo_type=None, revision=None):
        self._touch("create_commit")
        if self.fail_commit is not None:
            raise self.fail_commit
        for op in operations:
            with open(op.path_or_fileobj, "rb") as fh:
                data = bytearray(fh.read())
            if op.path_in_repo in self.corrupt and data:
                data[0] ^= 1
            self.files[op.path_in_repo] = bytes(data)
        self.commits.append([op.path_in_repo for op in operations])

    def get_paths_info(self, repo_id, paths, *, expand=False, repo_type=None, revision=None):
        self._touch("get_paths_info")
        out = []
        for path in paths:
            data = self.files.get(path)
            if data is None:
                continue
            entry = {"path": path, "size": len(data),
                     "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if path.endswith(self.LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
                entry["oid"] = "0" * 40  # the pointer's blob id, not the content's
            out.append(RepoFile(**entry))
        return out


def _state(step, **over):
    doc = dict(stage="pretraining", step=step, epoch=0, data_cursor=0, world_size=1, training_critical={},
               plan_fingerprint=None, plan_sha256=None, backends_used={"experts": "pytorch"}, lora=False,
               family="language")
    return {**doc, **over}


def _engine(payload):
    def write(tmp):
        (tmp / "state").mkdir()
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(payload)
    return write


def _run(tmp_path, steps=(10, 20, 30), export=True):
    out = tmp_path / "run"
    for step in steps:
        save_checkpoint(out, step, write_engine_state=_engine(b"weights-%d" % step), trainer_state=_state(step),
                        rank=0, world_size=1)
    if export:
        exp = out / "export"
        exp.mkdir()
        (exp / "model.safetensors").write_bytes(b"final weights")
        (exp / "config.json").write_text("{}")
        from ds_trhash.io import sha256_file

        entry = lambda p: {"sha256": sha256_file(p), "size": p.stat().st_size}  # noqa: E731
        import json

        (exp / "export_manifest.json").write_text(json.dumps({
            "format": "ds-trhash-export-v1",
            "weights": {"file": "model.safetensors", **entry(exp / "model.safetensors")},
            "files": {"config.json": entry(exp / "config.json")}}))
    return out


def _steps(out):
    return [c.step for c in list_checkpoints(out)]


def test_upload_then_verify_then_prune(tmp_path):
    out = _run(tmp_path)
    api = FakeHub(watch=[out / "checkpoints" / "step_00000010", out / "checkpoints" / "step_00000020"])
    lines = []
    report = sync(out, "me/run", api, prune_local=True, keep_last=1, log=lines.append)
    names = ["checkpoints/step_00000010", "checkpoints/step_00000020", "checkpoints/step_00000030", "export"]
    assert report.uploaded == names and report.verified == names
    assert report.pruned == names[:2] and report.kept == [names[2]]
    assert _steps(out) == [30] and (out / "export" / "model.safetensors").is_file()
    assert "checkpoints/step_00000010/MANIFEST.json" in api.files
    assert "checkpoints/step_00000010/state/mp_rank_00_model_states.pt" in api.files
    assert "export/export_manifest.json" in api.files and ".sync.lock" not in str(list(api.files))
    # every upload was followed by a verification before anything was deleted
    assert api.calls[-2:] == ["create_commit", "get_paths_info"]
    # a second sync finds everything verified and uploads nothing
    api.watch = []
    again = sync(out, "me/run", api, prune_local=True, keep_last=1, log=lines.append)
    assert again.uploaded == [] and again.already_remote == [names[2], names[3]] and again.pruned == []


@pytest.mark.parametrize("bad", ["checkpoints/step_00000020/state/mp_rank_00_model_states.pt",
                                 "checkpoints/step_00000020/trainer_state.json"])
def test_hash_mismatch_after_upload_prunes_nothing(tmp_path, bad):
    out = _run(tmp_path)
    api = FakeHub()
    api.corrupt.add(bad)  # an LFS file (SHA-256 check) and a regular file (git blob id check)
    with pytest.raises(SyncError, match="does not verify") as info:
        sync(out, "me/run", api, prune_local=True, keep_last=1, log=lambda line: None)
    assert bad in str(info.value)
    assert _steps(out) == [10, 20, 30]
    assert info.value.report.pruned == [] and info.value.report.verified == ["checkpoints/step_00000010"]


def test_incomplete_checkpoint_is_not_uploaded_nor_pruned(tmp_path):
    out = _run(tmp_path)
    (out / "checkpoints" / "step_00000020" / MANIFEST).unlink()
    api = FakeHub()
    report = sync(out, "me/run", api, prune_local=True, keep_last=1, log=lambda line: None)
    assert "checkpoints/step_00000020" in report.skipped
    assert not any(p.startswith("checkpoints/step_00000020/") for p in api.files)
    assert _steps(out) == [20, 30]  # step 10 verified and pruned; step 20 left for a person
    with pytest.raises(SyncError, match="only complete checkpoints"):
        sync(out / "checkpoints" / "step_00000020", "me/run", api, log=lambda line: None)


def test_failed_upload_prunes_nothing(tmp_path):
    out = _run(tmp_path)
    api = FakeHub()
    api.fail_commit = ConnectionError("connection reset by peer")
    with pytest.raises(SyncError, match="uploading checkpoints/step_00000010 .*connection reset"):
        sync(out, "me/run", api, prune_local=True, keep_last=1, log=lambda line: None)
    assert _steps(out) == [10, 20, 30] and api.files == {}


def test_lock_held_fails_fast_and_waits_when_allowed(tmp_path):
    out = _run(tmp_path)
    api = FakeHub()
    with sync_lock(out):
        start = time.monotonic()
        with pytest.raises(SyncError, match="held by another sync"):
            sync(out, "me/run", api, prune_local=True, log=lambda line: None)
        assert time.monotonic() - start < 2.0
        # a single checkpoint of the same run takes the same lock
        with pytest.raises(SyncError, match="held by another sync"):
            sync(out / "checkpoints" / "step_00000010", "me/run", api, log=lambda line: None)
    assert api.calls == [] and _steps(out) == [10, 20, 30]

    held = threading.Event()

    def holder():
        with sync_lock(out):
            held.set()
            time.sleep(0.3)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait()
    report = sync(out, "me/run", api, lock_timeout=5.0, log=lambda line: None)
    thread.join()
    assert len(report.verified) == 4


def test_dry_run_writes_and_deletes_nothing(tmp_path):
    out = _run(tmp_path)
    api = FakeHub()
    report = sync(out, "me/run", api, prune_local=True, keep_last=2, dry_run=True, log=lambda line: None)
    assert len(report.would_upload) == 4 and report.would_prune == ["checkpoints/step_00000010"]
    assert api.files == {} and "create_commit" not in api.calls and _steps(out) == [10, 20, 30]


def test_single_export_goes_to_repo_root_and_prune_needs_the_run_dir(tmp_path):
    out = _run(tmp_path)
    api = FakeHub()
    report = sync(out / "export", "me/model", api, log=lambda line: None)
    assert report.verified == ["export"] and set(api.files) == {"model.safetensors", "config.json",
                                                                 "export_manifest.json"}
    with pytest.raises(SyncError, match="needs the run output directory"):
        sync(out / "export", "me/model", api, prune_local=True, log=lambda line: None)
    with pytest.raises(SyncError, match="keep_last"):
        sync(out, "me/model", api, prune_local=True, keep_last=0, log=lambda line: None)


def test_token_never_in_errors_or_logs(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out = _run(tmp_path)
    api = FakeHub()
    api.fail_commit = PermissionError(f"401 Unauthorized: Authorization: Bearer {TOKEN}")
    lines = []
    caplog.set_level(logging.DEBUG)
    with pytest.raises(SyncError) as info:
        sync(out, "me/run", api, log=lines.append)
    assert "401" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    texts = [str(info.value), info.value.report.error or "", *lines, caplog.text]
    assert all(TOKEN not in t for t in texts)

    monkeypatch.setattr(hub, "make_api", lambda require_token=True: api)
    assert commands.main(["sync", "--local", str(out), "--repo-id", "me/run"]) == 2
    captured = capsys.readouterr()
    assert "401" in captured.err and TOKEN not in captured.err + captured.out

    with pytest.raises(SystemExit) as exit_info:
        commands.main(["sync", "--local", str(out), "--repo-id", "me/run", "--token", TOKEN])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "HF_TOKEN" in captured.err and TOKEN not in captured.err + captured.out


def test_make_api_takes_the_token_from_the_environment_only(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SyncError, match="HF_TOKEN is not set"):
        hub.make_api()
    assert hub.make_api(require_token=False).token is False  # anonymous, never a token file
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert hub.make_api().token == TOKEN


def test_cli_sync_reports(tmp_path, monkeypatch, capsys):
    out = _run(tmp_path)
    api = FakeHub()
    monkeypatch.setattr(hub, "make_api", lambda require_token=True: api)
    assert commands.main(["sync", "--local", str(out), "--repo-id", "me/run", "--prune-local",
                          "--keep-last", "2"]) == 0
    assert "pruned 1" in capsys.readouterr().out and _steps(out) == [20, 30]
