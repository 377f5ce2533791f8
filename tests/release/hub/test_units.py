"""What a sync uploads and how it compares a unit with the Hub (release/hub/units.py), through
the real client against the stand-in Hub: stale remote files, incomplete checkpoints, a single
export at the repository root."""
import pytest
from huggingface_hub import CommitOperationAdd

from ds_trhash.checkpoints import MANIFEST
from ds_trhash.release.hub import sync as hub
from ds_trhash.release.hub.sync import SyncError, sync
from tests.release.hub_fixtures import REPO, UNITS, assert_remote_equals_local, make_run, quiet, steps_of

def test_stale_files_in_a_checkpoint_folder_on_the_hub_are_deleted(tmp_path, server):
    out = make_run(tmp_path, steps=(10,))
    api = hub.make_api()
    api.create_repo(REPO, private=True)
    stale = f"{UNITS[0]}/state/mp_rank_01_model_states.pt"  # from an earlier two-rank run
    api.create_commit(REPO, [CommitOperationAdd(stale, b"old shard")], commit_message="earlier run")
    assert f"{stale}: on the Hub but not in the local manifest" in hub.remote_differences(
        api, REPO, hub.discover(out).units[0])
    report = sync(out, REPO, api, log=quiet)
    assert report.verified == [UNITS[0], "export"]
    assert stale not in server.repo(REPO).files
    assert_remote_equals_local(server, out, UNITS[0])


def test_incomplete_checkpoint_is_neither_uploaded_nor_pruned(tmp_path, server):
    out = make_run(tmp_path)
    (out / UNITS[1] / MANIFEST).unlink()
    report = sync(out, REPO, hub.make_api(), prune_local=True, keep_last=1, log=quiet)
    assert UNITS[1] in report.skipped
    assert not any(p.startswith(UNITS[1] + "/") for p in server.repo(REPO).files)
    assert steps_of(out) == [20, 30]  # step 10 verified and pruned; step 20 left for a person
    with pytest.raises(SyncError, match="only complete checkpoints"):
        sync(out / UNITS[1], REPO, hub.make_api(), log=quiet)


def test_a_single_export_goes_to_the_repo_root_and_prune_needs_the_run_dir(tmp_path, server):
    out = make_run(tmp_path)
    report = sync(out / "export", "me/model", hub.make_api(), log=quiet)
    assert report.verified == ["export"]
    assert set(server.repo("me/model").files) == {"model.safetensors", "config.json", "export_manifest.json"}
    with pytest.raises(SyncError, match="needs the run output directory"):
        sync(out / "export", "me/model", hub.make_api(), prune_local=True, log=quiet)
    with pytest.raises(SyncError, match="keep_last"):
        sync(out, "me/model", hub.make_api(), prune_local=True, keep_last=0, log=quiet)
