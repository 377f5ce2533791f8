"""The prefetch process's loop, driven in-process over a pipe: at most ``depth`` shards ready and
held, an answer after each fill, a new list letting go of what it no longer names, a failed shard
tried again only after the list changes, and "idle?" answered once nothing is left; the store
set up before the process says it is ready."""
import pickle
import threading
from multiprocessing import Pipe
from pathlib import Path

import pytest

from ds_trhash.data.stream.cache import CacheError, files as cf
from ds_trhash.data.stream.cache.fetch_worker import _Worker, serve
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.store.local import LocalStore
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus

KEYS = [("a", f"shard-{i:05d}.bin") for i in range(4)]


@pytest.fixture()
def worker(tmp_path):
    root = write_corpus(tmp_path / "store")
    cache = open_corpus(plan_for(root), str(root)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    ours, theirs = Pipe()
    yield _Worker(theirs, cache, depth=2, allowance=1), ours, cache
    cache.close()


def fill_all(w: _Worker) -> list:
    done = []
    while (key := w.next_key()) is not None:
        w.fill(key)
        done.append(key)
    return done


def test_at_most_depth_ready_one_held_and_an_answer_per_fill(worker):
    w, ours, cache = worker
    w.handle(("want", KEYS))
    assert fill_all(w) == KEYS[:2]
    for key in KEYS[:2]:
        kind, answered, result, counts, usage = ours.recv()
        assert (kind, answered, result) == ("filled", key, True)
        assert counts["prefetched"] == 1 and counts["downloaded_bytes"] == SHARD_BYTES and usage is not None  # as its last scan saw it
    assert not ours.poll(0)
    first, second = (cf.entry_path(cache.root, *key) for key in KEYS[:2])
    assert w.ready[KEYS[0]] is not None and w.ready[KEYS[1]] is None  # the allowance holds one
    assert not cf.try_evict(first) and cf.try_evict(second)


def test_a_shard_found_verified_already_is_held_without_an_answer(worker):
    """Nothing changed that the rank counts: a warm cache costs the reading rank no message."""
    w, ours, cache = worker
    w.handle(("want", KEYS[:2]))
    fill_all(w)
    assert [ours.recv()[1] for _ in range(2)] == KEYS[:2]
    w.handle(("want", ()))  # let go of both
    w.handle(("want", KEYS[:2]))
    assert fill_all(w) == KEYS[:2] and not ours.poll(0)
    assert w.ready[KEYS[0]] is not None and not cf.try_evict(cf.entry_path(cache.root, *KEYS[0]))


def test_a_new_list_lets_go_of_what_it_no_longer_names(worker):
    w, ours, cache = worker
    w.handle(("want", KEYS))
    fill_all(w)
    w.handle(("want", KEYS[1:]))  # the rank holds KEYS[0] now
    assert set(w.ready) == {KEYS[1]} and cf.try_evict(cf.entry_path(cache.root, *KEYS[0]))
    assert fill_all(w) == [KEYS[2]]


def test_a_failed_shard_is_tried_again_only_after_the_list_changes(worker):
    w, ours, _ = worker
    unknown = ("a", "shard-00099.bin")
    w.handle(("want", (unknown, KEYS[0])))
    assert fill_all(w) == [unknown, KEYS[0]]
    answer = ours.recv()
    assert isinstance(answer[2], CacheError) and "not in that source's manifest" in str(answer[2])
    assert w.next_key() is None and unknown in w.tried
    w.handle(("want", (unknown,)))
    assert w.next_key() == unknown


def test_idle_is_answered_once_nothing_is_left_to_fill(worker):
    w, ours, _ = worker
    w.handle(("want", KEYS[:1]))
    w.handle(("idle?",))
    assert not ours.poll(0) and w.asked_idle  # one fill to go
    fill_all(w)
    ours.recv()  # its answer
    w.handle(("idle?",))
    assert ours.recv() == ("idle",)


class SetUpStore(LocalStore):
    """A directory store that leaves a file behind when it is set up (in the worker: its copy)."""

    def __init__(self, root: Path, marker: Path) -> None:
        super().__init__(root)
        self.marker = marker

    def warm_up(self) -> None:
        self.marker.write_text("set up")


def test_the_store_is_set_up_before_the_process_says_ready(tmp_path):
    """A Hub store's client is made ready as the process starts, not in its first download (which
    a read may be waiting for)."""
    root = write_corpus(tmp_path / "store")
    cache = open_corpus(plan_for(root), str(root)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    recipe = {"store": SetUpStore(root, tmp_path / "set-up"), "cache_dir": cache.cache_dir, "max_bytes": cache.max_bytes,
              "shards": cache._shards, "commit": cache.commit, "depth": 2, "allowance": 1}
    ours, theirs = Pipe()
    process = threading.Thread(target=serve, args=(theirs,))
    process.start()
    ours.send_bytes(pickle.dumps(recipe))
    assert ours.recv() == ("ready",) and (tmp_path / "set-up").read_text() == "set up"
    ours.close()  # the rank is gone: the loop ends
    process.join(10)
    assert not process.is_alive()
    cache.close()



@pytest.mark.parametrize("leaves", ["before the recipe", "before the process is ready"])
def test_a_rank_that_leaves_early_ends_the_process_quietly(tmp_path, leaves):
    """A launch refused or failed right after its stream started closes the connection while the
    process is still starting: it ends without a word (a BrokenPipeError traceback on the
    launch's console came before the launch's own error line)."""
    root = write_corpus(tmp_path / "store")
    cache = open_corpus(plan_for(root), str(root)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    recipe = {"store": LocalStore(root), "cache_dir": cache.cache_dir, "max_bytes": cache.max_bytes,
              "shards": cache._shards, "commit": cache.commit, "depth": 2, "allowance": 1}
    ours, theirs = Pipe()
    if leaves == "before the process is ready":
        ours.send_bytes(pickle.dumps(recipe))  # read from the connection after the rank closed it
    ours.close()
    serve(theirs)  # returns; raises nothing
    cache.close()
