"""The corpus a run first read is its corpus: its commit read again, other bytes refused, a moved branch said."""
import pytest

from ds_trhash.data.stream.corpus import CorpusChanged, check_same_bytes, moved_note, open_corpus, pinned_commit
from ds_trhash.data.stream.store import HubStore, LocalStore
from tests.data.hub_corpus import REPO, hub_corpus  # noqa: F401 (fixture)
from tests.release.hub_server import seed_dataset


def test_the_commit_is_read_again_only_from_the_same_store(tmp_path):
    store = LocalStore(tmp_path)
    assert pinned_commit({"store": store.identity, "commit": "local"}, store) is None
    assert pinned_commit({"store": "hf:x/datasets/o/r", "commit": "a" * 40}, store) is None  # a copy: bytes decide
    assert pinned_commit(None, store) is None


def test_other_bytes_under_the_same_names_are_refused_naming_the_file():
    saved = {"store": "local:/a", "shards": {"web/s0.bin": "a" * 64, "web/s1.bin": "b" * 64}}
    check_same_bytes(saved, {"store": "local:/b", "shards": {"web/s0.bin": "a" * 64, "web/s1.bin": "b" * 64}}, "x", "fix")
    check_same_bytes({"store": "local:/a", "commit": "local"}, {"shards": {}}, "x", "fix")  # an older record: no hashes
    with pytest.raises(CorpusChanged, match=r"the corpus at local:/b is not the one pretraining read: web/s1.bin has "
                                            r"sha256 cccccccccccc… now, bbbbbbbbbbbb… when pretraining read it; do this"):
        check_same_bytes(saved, {"store": "local:/b", "shards": {"web/s0.bin": "a" * 64, "web/s1.bin": "c" * 64}},
                         "pretraining", "do this")


def test_a_moved_branch_is_said_and_the_recorded_commit_kept(hub_corpus):
    hub, root, plan = hub_corpus
    first = open_corpus(plan, None, store=HubStore(REPO, "main", backoff_s=0.01))
    saved = first.record
    assert moved_note(saved, first.store, first.commit, "this run") is None  # nothing moved yet
    moved = seed_dataset(hub, REPO, {"b/shard-00003.bin": None})
    store = HubStore(REPO, "main", backoff_s=0.01)
    again = open_corpus(plan, None, pinned=pinned_commit(saved, store), store=store)
    assert again.commit == first.commit != moved
    note = moved_note(saved, again.store, again.commit, "this run")
    assert note == (f"'main' of {store.identity} has moved to {moved[:12]} since this run read it; reading commit "
                    f"{first.commit[:12]}, the corpus this run trained on (to train on the new commit, start a new run)")
