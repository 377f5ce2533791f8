"""The launch's data question over a local store (the Hub one: tests/data/stream/store/test_hub.py)."""
import pytest

from ds_trhash.data.stream.cache import CacheError
from ds_trhash.data.stream.corpus import CorpusError, open_corpus, resume_commit
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus
from tests.fail_closed import tree_digest


@pytest.fixture()
def root(tmp_path):
    return write_corpus(tmp_path / "corpus")


def test_a_good_corpus_answers_with_every_planned_shard(root):
    corpus = open_corpus(plan_for(root), str(root))
    assert corpus.commit == "local" and len(corpus.shards) == 12
    assert {s.size for s in corpus.shards.values()} == {SHARD_BYTES}
    assert corpus.sources_at_once() == 2  # the plan interleaves sources a and b
    assert corpus.min_cache_bytes(3) == (3 + 2) * SHARD_BYTES  # one a rank (3 > 2 sources), 2 prefetched
    assert corpus.min_cache_bytes(1) == (2 + 2) * SHARD_BYTES  # one a source, 2 prefetched


def test_missing_truncated_and_changed_shards_are_named(root):
    plan = plan_for(root)
    (root / "a" / "shard-00002.bin").unlink()
    (root / "b" / "shard-00001.bin").write_bytes(b"\0" * 10)
    before = tree_digest(root)
    with pytest.raises(CorpusError, match=r"a/shard-00002.bin is missing .*b/shard-00001.bin holds 10 bytes, "
                                          rf"its manifest {SHARD_BYTES}"):
        open_corpus(plan, str(root))
    assert tree_digest(root) == before


def test_deep_hashes_every_planned_shard(root):
    plan = plan_for(root)
    shard = root / "a" / "shard-00003.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    open_corpus(plan, str(root))  # sizes agree: the launch finds it when the cache hashes it
    with pytest.raises(CorpusError, match="a/shard-00003.bin has sha256 [0-9a-f]{64}, its manifest"):
        open_corpus(plan, str(root), deep=True)


def test_a_source_without_manifest_names_it(root):
    plan = plan_for(root)
    (root / "b" / "manifest.json").unlink()
    with pytest.raises(CorpusError, match="has no b/manifest.json; the plan reads source 'b'"):
        open_corpus(plan, str(root))


def test_bound_and_resume_commit_rules(root):
    corpus = open_corpus(plan_for(root), str(root))
    with pytest.raises(CacheError, match=rf"a shard of each of the 2 sources read at once .* plus 2 fetched ahead; the "
                                         rf"smallest bound that works is {4 * SHARD_BYTES} bytes"):
        corpus.check_cache_bound(3 * SHARD_BYTES, 2, "data.cache_gb")
    corpus.check_cache_bound(4 * SHARD_BYTES, 2, "data.cache_gb")
    assert resume_commit(str(root), {}, {"commit": "local"}) is None
    saved = {"commit": "a" * 40}
    assert resume_commit(None, {"dataset": "hf://datasets/o/r", "revision": "main"}, saved) == "a" * 40
    with pytest.raises(CorpusError, match=f"read commit {'a' * 40}.*asks for commit {'b' * 40}"):
        resume_commit(f"hf://datasets/o/r@{'b' * 40}", {}, saved)
