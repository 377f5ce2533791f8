"""The Hub store and the node cache through the real huggingface_hub client and the loopback
stand-in: same rows as a local read, faults survived, refusals named, the token never written."""
from __future__ import annotations

import pytest
import torch

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.cache import ShardIntegrityError
from ds_trhash.data.stream.corpus import CorpusError, open_corpus, resume_commit
from ds_trhash.data.stream.delivery import ReplayReader
from ds_trhash.data.stream.store import HubStore, StoreError, StoreUnavailable, open_store
from tests.data.hub_corpus import REPO, SHARD_BYTES, TOKEN, hub_corpus  # noqa: F401 (fixture)
from tests.fail_closed import tree_digest
from tests.release.hub_server import seed_dataset

FILE = "a/shard-00001.bin"


def fast_store(**kw) -> HubStore:
    return HubStore(REPO, "main", backoff_s=0.01, **kw)


def rows(reader, steps=6):
    layout = BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1)
    return [reader.batch(step, 0, layout) for step in range(steps)]


def test_rows_from_the_hub_equal_rows_from_local_disk(hub_corpus, tmp_path):
    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, store=fast_store())
    assert len(corpus.commit) == 40 and corpus.record == {
        "store": f"hf:{hub.url}/datasets/{REPO}", "commit": corpus.commit, "revision": "main",
        "shards": {shard.path: shard.sha256 for shard in corpus.shards.values()}}  # every planned shard's hash
    with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES) as cache:
        remote = rows(ReplayReader(plan, None, 5, cache=cache))
        local = rows(ReplayReader(plan, root, 5))
        for (a, b), (c, d) in zip(remote, local):
            assert torch.equal(a, c) and torch.equal(b, d)
        again = rows(ReplayReader(plan, None, 5, cache=cache))  # all cached now: no new download
        assert all(torch.equal(x[0], y[0]) for x, y in zip(again, remote))
    assert max(hub.served.values()) == 1  # each shard downloaded once
    assert hub.counts.get("tree") == 1  # one listing for the whole corpus


@pytest.mark.parametrize("fault", ["503", "429", "drop", "stall", "corrupt"])
def test_a_fault_is_survived_with_the_same_bytes(hub_corpus, tmp_path, fault):
    hub, root, plan = hub_corpus
    hub.stall_s = 3.0
    corpus = open_corpus(plan, None, store=fast_store(stall_s=0.5))
    hub.file_faults[FILE] = [fault]
    with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0) as cache:
        assert cache.get("a", "shard-00001.bin").read_bytes() == (root / FILE).read_bytes()
        assert cache.stats()["redownloads"] == (1 if fault == "corrupt" else 0)
        # the verified shard's bytes, once, whatever the transfers that failed before it
        assert cache.counters()["downloaded_bytes"] == (root / FILE).stat().st_size
    assert hub.file_faults[FILE] == []


def test_persistent_faults_stop_naming_the_file_and_endpoint(hub_corpus, tmp_path):
    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, store=fast_store(attempts=3))
    cache = corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    hub.file_faults[FILE] = ["503"] * 3
    with pytest.raises(StoreUnavailable, match=rf"cannot get {FILE} .* from the Hub at {hub.url} after 3 attempts"):
        cache.get("a", "shard-00001.bin")
    hub.file_faults[FILE] = ["corrupt", "corrupt"]
    with pytest.raises(ShardIntegrityError, match=r"shard a/shard-00001.bin from .*two downloads hashed [0-9a-f]{64} "
                                                  r"and [0-9a-f]{64}, its manifest records sha256"):
        cache.get("a", "shard-00001.bin")
    assert not [p for p in (tmp_path / "cache").rglob("shard-00001.bin*") if not p.name.endswith((".lock", ".hold"))]


def test_missing_shard_is_refused_at_open_naming_it(hub_corpus, tmp_path):
    hub, root, plan = hub_corpus
    seed_dataset(hub, REPO, {"b/shard-00003.bin": None})
    before = tree_digest(tmp_path)
    with pytest.raises(CorpusError, match=r"at commit [0-9a-f]{40} do not match the plan: b/shard-00003.bin is missing"):
        open_corpus(plan, None, store=fast_store())
    assert tree_digest(tmp_path) == before


def test_a_resume_reads_its_commit_after_main_moved(hub_corpus, tmp_path):
    hub, root, plan = hub_corpus
    first = open_corpus(plan, None, store=fast_store())
    moved = seed_dataset(hub, REPO, {"b/shard-00003.bin": None})  # main moves on, losing a shard
    pinned = resume_commit(None, plan, first.record)
    again = open_corpus(plan, None, pinned=pinned, store=fast_store())
    assert again.commit == first.commit != moved
    with again.open_cache(tmp_path / "cache", 100 * SHARD_BYTES) as cache:
        assert cache.get("b", "shard-00003.bin").read_bytes() == (root / "b/shard-00003.bin").read_bytes()
    other = f"hf://datasets/{REPO}@{moved}"
    with pytest.raises(CorpusError, match=f"this run read commit {first.commit}.*asks for commit {moved}"):
        resume_commit(other, plan, first.record)


def test_unreachable_hub_names_the_endpoint(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(StoreUnavailable, match=r"from the Hub at http://127.0.0.1:9 after 2 attempts"):
        HubStore(REPO, attempts=2, backoff_s=0.01).resolve()


def test_shards_dir_names_a_mirror_or_a_directory(tmp_path):
    plan = {"dataset": f"hf://datasets/{REPO}", "revision": "main"}
    assert open_store(None, plan, "c.yaml").repo_id == REPO
    mirror = open_store("hf://datasets/me/mirror@v2", plan, "c.yaml")
    assert (mirror.repo_id, mirror.revision) == ("me/mirror", "v2")
    assert open_store(str(tmp_path), plan, "c.yaml").root == tmp_path
    with pytest.raises(StoreError, match="data.shards_dir: 'hf://datasets/x' is not hf://datasets/OWNER/REPO"):
        open_store("hf://datasets/x", plan, "c.yaml")
    with pytest.raises(StoreError, match="the plan's dataset 'pydoc' is not an hf://datasets"):
        open_store(None, {"dataset": "pydoc"}, "c.yaml")


def test_the_token_is_in_no_file_written(hub_corpus, tmp_path):
    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, store=fast_store())
    with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES) as cache:
        rows(ReplayReader(plan, None, 5, cache=cache))
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not [p for p in written if TOKEN.encode() in p.read_bytes()]


def test_an_outage_with_retry_after_is_waited_out_with_one_line_per_wait(hub_corpus, tmp_path):
    """Every request answered 503 with Retry-After for a while (listing and downloads alike): the
    store waits as the Hub asks, says so once per wait, and delivers the same bytes."""
    import time

    hub, root, plan = hub_corpus
    lines: list[str] = []
    store = HubStore(REPO, "main", backoff_s=0.01, say=lines.append)
    corpus = open_corpus(plan, None, store=store)
    hub.outage_headers = {"Retry-After": "1"}
    hub.outage_until = time.monotonic() + 2.5
    started = time.monotonic()
    with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0) as cache:
        assert cache.get("a", "shard-00001.bin").read_bytes() == (root / FILE).read_bytes()
    waited = time.monotonic() - started
    assert hub.outage_answers >= 2 and 2.0 <= waited < 10  # Retry-After (1 s), not the 0.01 s backoff
    assert len(lines) == hub.outage_answers
    assert all(line.startswith(f"Hub answers HTTP 503 for {FILE}") and "retrying in 1 s, waited" in line
               and line.endswith("of 30 m") for line in lines)


def test_a_rate_limit_waits_for_its_reset(hub_corpus):
    import time

    hub, root, plan = hub_corpus
    lines: list[str] = []
    store = HubStore(REPO, "main", backoff_s=0.01, say=lines.append)
    hub.outage_status = 429
    hub.outage_headers = {"RateLimit": '"resolvers";r=0;t=1', "RateLimit-Policy": '"fixed window";"resolvers";q=3000;w=300'}
    hub.outage_until = time.monotonic() + 0.5
    started = time.monotonic()
    assert len(store.resolve()) == 40
    assert time.monotonic() - started >= 1.0 and lines and "HTTP 429" in lines[0] and "retrying in 1 s" in lines[0]


def test_an_outage_longer_than_the_budget_stops_naming_it(hub_corpus, tmp_path):
    import time

    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, store=HubStore(REPO, "main", backoff_s=0.2, budget_s=1.0, say=lambda line: None))
    hub.outage_until = time.monotonic() + 60
    before = tree_digest(tmp_path)
    with pytest.raises(StoreUnavailable, match=rf"cannot get {FILE} .* from the Hub at {hub.url} after \d+ attempts "
                                               r"over \d+ s \(last: HTTP 503\).*relaunch later"):
        with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0) as cache:
            cache.get("a", "shard-00001.bin")
    hub.outage_until = 0.0
    assert not [p for p in (tmp_path / "cache").rglob("*.partial-*")]
    assert {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith("cache")} == before


def test_a_shard_is_hashed_as_it_streams_in_never_read_back(hub_corpus, tmp_path, monkeypatch):
    from ds_trhash.data.stream.cache import shard_cache as cache_module

    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, store=fast_store())

    def no_rereads(path):
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(cache_module, "sha256_file", no_rereads)
    hub.file_faults[FILE] = ["drop"]  # a cut transfer: resumed by Range, still hashed once
    with corpus.open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0) as cache:
        assert cache.get("a", "shard-00001.bin").read_bytes() == (root / FILE).read_bytes()


def test_deep_checks_read_the_hubs_own_hashes_instead_of_downloading(hub_corpus):
    hub, root, plan = hub_corpus
    corpus = open_corpus(plan, None, deep=True, store=fast_store())
    assert corpus.shards and not [p for p in hub.served if p.endswith(".bin")]  # the listing's LFS sha256 compared
    other = bytearray((root / FILE).read_bytes())
    other[3] ^= 0xFF
    seed_dataset(hub, REPO, {FILE: bytes(other)})  # main moves to other bytes, same size, the old manifest
    with pytest.raises(CorpusError, match="a/shard-00001.bin has sha256 [0-9a-f]{64} in the listing, its manifest"):
        open_corpus(plan, None, deep=True, store=fast_store())
