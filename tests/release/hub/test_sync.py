"""Hub sync through the real ``huggingface_hub`` client against a stand-in Hub on loopback
(tests/release/hub_server.py): uploads, remote hash verification, a dropped upload, retry, and
the ``--prune-local`` rules (release/hub/sync.py: the upload loop and its report)."""
import pytest

from ds_trhash.checkpoints import MANIFEST, rotate_unless_syncing
from ds_trhash.checkpoints.sync_guard import LOCK_FILE, read_verified
from ds_trhash.io import sha256_file
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub.sync import SyncError, sync
from tests.release.hub_fixtures import REPO, UNITS, assert_remote_equals_local, make_run, quiet, steps_of, tree_digest

def test_upload_verify_then_prune_and_a_second_pass_uploads_nothing(tmp_path, server):
    out = make_run(tmp_path)
    watched = [out / u for u in UNITS]
    # nothing local is deleted while the Hub is still being talked to about it
    server.observers.append(lambda name: all(p.is_dir() for p in watched) or pytest.fail(f"deleted during {name}"))
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert report.uploaded == UNITS and report.verified == UNITS
    assert report.pruned == UNITS[:2] and report.kept == [UNITS[2]]
    assert steps_of(out) == [30] and (out / "export" / "model.safetensors").is_file()
    # what rotation (checkpoint.keep_unsynced), cleanup and the watcher read: the verified units still on disk
    assert read_verified(out) == {UNITS[2]: {"manifest_sha256": sha256_file(out / UNITS[2] / MANIFEST),
                                             "repo_id": REPO},
                                  UNITS[3]: {"manifest_sha256": sha256_file(out / UNITS[3] / "export_manifest.json"),
                                             "repo_id": REPO}}
    repo = server.repo(REPO)
    assert repo.private and len(repo.commits) == 4  # created private, one commit per unit
    for unit in UNITS[2:]:
        assert_remote_equals_local(server, out, unit)
    assert not any(LOCK_FILE in p for p in repo.files)
    # the LFS objects went through the batch API and one pre-signed PUT each, then were committed by oid
    assert server.counts["lfs_upload"] == server.counts["lfs_verify"] == len(server.lfs_store) >= 4
    server.observers.clear()

    again = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert again.uploaded == [] and again.already_remote == UNITS[2:] and again.pruned == []
    assert len(repo.commits) == 4



@pytest.mark.parametrize("bad", ["checkpoints/step_00000020/state/mp_rank_00_model_states.pt",  # LFS: SHA-256
                                 "checkpoints/step_00000020/trainer_state.json"])  # regular: git blob id
def test_a_remote_hash_mismatch_stops_the_sync_and_prunes_nothing(tmp_path, server, bad):
    out = make_run(tmp_path)
    server.corrupt.add(bad)
    before = tree_digest(out)
    with pytest.raises(SyncError, match="does not verify") as info:
        sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert bad in str(info.value)
    assert info.value.report.pruned == [] and info.value.report.verified == [UNITS[0]]
    assert tree_digest(out) == before and list(read_verified(out)) == [UNITS[0]]
    # the trainer's rotation with checkpoint.keep_unsynced deletes what this sync verified, nothing else
    removed = rotate_unless_syncing(out, keep_last=1, keep_unsynced=True, log=quiet)
    assert [p.name for p in removed] == ["step_00000010"] and steps_of(out) == [20, 30]


def test_a_dropped_upload_prunes_nothing_and_the_next_pass_completes(tmp_path, server):
    out = make_run(tmp_path)
    before = tree_digest(out)
    server.drop["commit"] = {2}  # the second unit's commit: connection closed half-way through the body
    with pytest.raises(SyncError, match=f"uploading {UNITS[1]} to {REPO} failed") as info:
        sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert info.value.report.verified == [UNITS[0]] and info.value.report.pruned == []
    assert tree_digest(out) == before and steps_of(out) == [10, 20, 30] and list(read_verified(out)) == [UNITS[0]]
    assert not any(p.startswith(UNITS[1]) for p in server.repo(REPO).files)  # a commit is all or nothing
    assert set(server.lfs_store) >= {sha256_file(out / UNITS[1] / "state" / "mp_rank_00_model_states.pt")}

    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert report.already_remote == [UNITS[0]] and report.uploaded == UNITS[1:]
    assert report.pruned == UNITS[:2] and steps_of(out) == [30] and list(read_verified(out)) == UNITS[2:]
    # step 20's weights reached the LFS store before the drop; the retry commits them without a new PUT
    assert server.counts["lfs_upload"] == len(server.lfs_store)


def test_dry_run_creates_uploads_and_deletes_nothing(tmp_path, server):
    out = make_run(tmp_path)
    before = tree_digest(out)
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=2, dry_run=True, log=quiet)
    assert report.would_upload == UNITS and report.would_prune == [UNITS[0]]
    assert server.repos == {} and "commit" not in server.requests and tree_digest(out) == before
