"""The stream a training step reads: its rows through the node cache are the direct reader's for a
whole plan (cold, warm, after eviction, across a resume), and its background assembly stops on
every way out, leaving no thread behind."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

from ds_trhash.data.stream.delivery import RankStream, ReaderError, ReplayReader, THREAD_NAME, open_stream
from ds_trhash.data.stream.cache import CacheError, ShardIntegrityError
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.batch_layout import BatchLayout
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus

SEED = 3
STEPS = 12  # 48 rows, global batch 4
LAYOUTS = [BatchLayout(micro_batch=1, grad_accum=2, rank=rank, world_size=2) for rank in (0, 1)]


@pytest.fixture()
def store(tmp_path):
    return write_corpus(tmp_path / "store")


def assembly_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def fetch_workers() -> list[int]:
    """This process's prefetch processes (``fetch_worker``) still running or not yet reaped."""
    children = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            children += open(f"/proc/self/task/{task}/children").read().split()
    found = []
    for pid in children:
        with contextlib.suppress(FileNotFoundError):  # exited and reaped since the listing
            if b"fetch_worker" in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(int(pid))
    return found


def direct(root, layout: BatchLayout, steps=range(STEPS)) -> list:
    reader = ReplayReader(plan_for(root), root, SEED)
    return [[reader.batch(s, m, layout)
             for m in range(layout.grad_accum)] for s in steps]


def streamed(root, cache_dir, limit, layout, steps=range(STEPS), prefetch=2) -> tuple[list, dict]:
    cache = open_corpus(plan_for(root), str(root)).open_cache(cache_dir, limit, prefetch=prefetch)
    with RankStream(ReplayReader(plan_for(root), None, SEED, cache=cache), layout, end=STEPS) as stream:
        got = [stream.micro_batches(s) for s in steps]
        cache.wait_idle()
        counts = cache.counters()
    assert not assembly_threads()
    return got, counts


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])
                                                             for p, q in zip(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["rank0", "rank1"])
def test_rows_through_the_cache_are_the_direct_readers_cold_warm_evicted_and_resumed(store, tmp_path, layout):
    expected = direct(store, layout)
    cold, counts = streamed(store, tmp_path / "cache", 100 * SHARD_BYTES, layout)
    assert same(cold, expected) and counts["misses"] + counts["prefetched"] > 0
    warm, counts = streamed(store, tmp_path / "cache", 100 * SHARD_BYTES, layout)  # every entry verified before
    assert same(warm, expected) and counts["misses"] == counts["prefetched"] == 0 and counts["hits"] > 0
    evicted, counts = streamed(store, tmp_path / "small", 2 * SHARD_BYTES, layout)
    assert same(evicted, expected) and counts["evictions"] > 0
    resumed, _ = streamed(store, tmp_path / "resume", 100 * SHARD_BYTES, layout, steps=range(5, STEPS))
    assert same(resumed, expected[5:])  # a resume starts the stream at its step: the same rows
    jumped, _ = streamed(store, tmp_path / "resume", 3 * SHARD_BYTES, layout, steps=[2, 3, 9, 1, 10, 11])
    assert same(jumped, [expected[s] for s in (2, 3, 9, 1, 10, 11)])  # any order: a pure function of the step


class _Recorded:
    """A lock that records being taken."""

    def __init__(self, taken: list) -> None:
        self.taken = taken

    def __enter__(self):
        self.taken.append("evict lock")

    def __exit__(self, *exc):
        return False


def test_the_figures_add_up_and_cost_no_walk(store, tmp_path, monkeypatch):
    from ds_trhash.data.stream.cache import files as cf

    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES)
    with RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[0], end=STEPS) as stream:
        for step in range(STEPS):
            stream.micro_batches(step)
        assert cache.wait_idle()
        walks = []
        monkeypatch.setattr(cf, "scan", lambda *a, **k: walks.append(a))
        monkeypatch.setattr(cf, "scan_all", lambda *a, **k: walks.append(a))
        monkeypatch.setattr(cf, "read_usage", lambda *a, **k: walks.append(a))
        monkeypatch.setattr(cache, "_evict_lock", _Recorded(walks))
        figures = stream.figures()
    monkeypatch.undo()
    assert not walks  # no lock taken, nothing walked or read: cheap at every step on every rank
    assert figures.steps == STEPS and figures.background and figures.cached
    assert figures.assembly_s == pytest.approx(figures.read_s + figures.shard_wait_s) and figures.shard_wait_s > 0
    assert figures.hits + figures.fetched > 0 and figures.cache_files is not None
    # the bytes downloaded: every entry of this fresh cache (nothing evicted), each counted once
    entries = [p for p in (tmp_path / "cache").rglob("*.bin") if p.is_file()]
    assert entries and figures.downloaded_bytes == sum(p.stat().st_size for p in entries)
    warm = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES)
    with RankStream(ReplayReader(plan_for(store), None, SEED, cache=warm), LAYOUTS[0], end=STEPS) as stream:
        for step in range(STEPS):
            stream.micro_batches(step)
        assert warm.wait_idle()
        again = stream.figures()
    assert again.hits > 0 and again.downloaded_bytes == 0  # all verified in the cache: nothing downloaded


@pytest.mark.parametrize("fetch_process", [False, True], ids=["prefetch-thread", "prefetch-process"])
def test_closing_while_steps_wait_in_the_queue_leaves_no_thread(store, tmp_path, fetch_process):
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES,
                                                               fetch_process=fetch_process)
    stream = RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[0], ahead=2)
    stream.micro_batches(0)
    deadline = time.monotonic() + 10
    while len(stream._ahead._ready) < 2 and time.monotonic() < deadline:  # steps 1 and 2 assembled, 3 waits
        time.sleep(0.01)
    assert len(stream._ahead._ready) == 2 and assembly_threads()
    assert bool(fetch_workers()) == fetch_process
    stream.close()
    assert not assembly_threads() and cache._closed and not fetch_workers()
    with pytest.raises(RuntimeError, match="closed RankStream"):
        stream.micro_batches(1)


def test_closing_while_a_read_waits_for_room_cuts_the_wait_short(store, tmp_path):
    """The bound holds one shard and another reader holds it: the stream's read waits for room;
    closing the stream (from another thread, as a stop would) ends the wait and the thread."""
    other = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", SHARD_BYTES, prefetch=0)
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", SHARD_BYTES, prefetch=0)
    stream = RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[0])
    needed = {ref[:2] for ref in stream.reader.global_rows(0, 4)}  # step 0, both ranks
    hog = next(key for key in sorted(cache._shards) if key not in needed)
    outcome = []
    with other.held(*hog):
        consumer = threading.Thread(target=lambda: outcome.append(_raised(stream.micro_batches, 0)))
        consumer.start()
        time.sleep(0.5)
        assert consumer.is_alive() and assembly_threads()  # waiting for room
        started = time.monotonic()
        stream.close()
        consumer.join(10)
    assert time.monotonic() - started < 5 and not consumer.is_alive() and not assembly_threads()
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    other.close()


def _raised(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 (what the test looks at)
        return exc
    return None


def test_an_error_while_assembling_is_raised_at_its_step_and_ends_the_thread(store, tmp_path):
    doc = plan_for(store)
    cache = open_corpus(doc, str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    reader = ReplayReader(doc, None, SEED, cache=cache)
    first_use = {}
    for step in range(STEPS):
        for source, file, _ in reader.global_rows(step * 4, 4):
            first_use.setdefault((source, file), step)
    (source, file), bad_step = max(first_use.items(), key=lambda item: item[1])
    assert bad_step >= 2
    shard = store / source / file
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    layout = BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1)
    with RankStream(reader, layout, end=STEPS) as stream:
        for step in range(bad_step):
            stream.micro_batches(step)
        with pytest.raises(ShardIntegrityError, match=f"shard {source}/{file}"):
            stream.micro_batches(bad_step)
        deadline = time.monotonic() + 5
        while assembly_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not assembly_threads()  # stopped at the error, before any close
    assert cache._closed


def test_a_step_past_the_plan_is_refused_as_before(store, tmp_path):
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES)
    with RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[0]) as stream:
        stream.micro_batches(STEPS - 1)
        with pytest.raises(ReaderError, match="automatic dataset repetition is forbidden"):
            stream.micro_batches(STEPS)
    assert not assembly_threads()


@pytest.mark.parametrize("fetch_process", [False, True], ids=["prefetch-thread", "prefetch-process"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, ValueError])
def test_leaving_the_block_by_an_exception_closes_everything(store, tmp_path, exc, fetch_process):
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES,
                                                               fetch_process=fetch_process)
    with pytest.raises(exc):
        with RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[1]) as stream:
            stream.micro_batches(0)
            raise exc()
    assert not assembly_threads() and cache._closed and not cache._holding and not fetch_workers()
    assert cache._prefetcher.thread is None or not cache._prefetcher.thread.is_alive()


def test_a_closed_cache_refuses_to_wait_for_room(store, tmp_path):
    other = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", SHARD_BYTES, prefetch=0)
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", SHARD_BYTES, prefetch=0)
    with other.held("a", "shard-00000.bin"):
        cache.close()
        with pytest.raises(CacheError, match="was closed while shard-00001.bin waited for room"):
            cache.get("a", "shard-00001.bin")
    other.close()


def test_the_first_step_is_assembled_before_it_is_asked_for(store, tmp_path):
    """A stage opens its stream at its first step (here a resume at step 5): the step is assembled
    in the background, its shards fetched, before the loop asks for it, and it holds the direct
    reader's rows."""
    layout = LAYOUTS[1]
    corpus = open_corpus(plan_for(store), str(store))
    with open_stream(corpus, plan_for(store), SEED, layout, tmp_path / "cache", 100 * SHARD_BYTES, 1, end=STEPS,
                     first_step=5) as stream:
        deadline = time.monotonic() + 30
        while not stream._ahead._ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stream._ahead._ready and stream._ahead._ready[0][0] == 5
        assert stream.reader.cache.counters()["misses"] > 0  # read from the store before any step was asked
        assert same([stream.micro_batches(5)], direct(store, layout, steps=[5]))
    assert not assembly_threads() and not fetch_workers()


def test_pinned_batches_are_made_for_the_openers_device(store, tmp_path, monkeypatch):
    """The assembly thread's current CUDA device would be device 0 (a context of every rank on GPU
    0): it is set to the device current where the stream was opened. (CPU here: the CUDA calls are
    recorded, pinning returns the tensor.)"""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((device, threading.current_thread().name)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES)
    with RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), LAYOUTS[0], pin_memory=True,
                    end=STEPS) as stream:
        assert same([stream.micro_batches(0)], direct(store, LAYOUTS[0], steps=[0]))
    assert calls and set(calls) == {(3, THREAD_NAME)}


def test_a_steps_read_waits_for_a_shard_no_longer_than_its_budget(store, tmp_path):
    """One node: a shard another process of the node keeps downloading (its lock held) is waited
    for no longer than one step's budget (data.hub_wait_minutes), then that step raises as the
    store being away, on the rank that needed it."""
    from filelock import FileLock

    from ds_trhash.data.stream.cache import files as cf
    from ds_trhash.data.stream.store.base import ReadTimedOut

    cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / "cache", 100 * SHARD_BYTES, prefetch=0)
    reader = ReplayReader(plan_for(store), None, SEED, cache=cache)
    source, file, _ = reader.global_rows(0, 1)[0]
    path = cf.entry_path(cache.root, source, file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cf.side(path, cf.LOCK)), is_singleton=False):
        with RankStream(reader, LAYOUTS[0], end=STEPS, budget_s=0.5) as stream:
            started = time.monotonic()
            with pytest.raises(ReadTimedOut, match=f"cannot get {source}/{file} within data.hub_wait_minutes .* was still downloading it"):
                stream.micro_batches(0)
            assert 0.4 < time.monotonic() - started < 5


def _failing_at(stream: RankStream, step: int, error: BaseException, release: threading.Event | None = None):
    """The stream's reader raises ``error`` for ``step`` (after ``release``, when given)."""
    real = stream.reader.batch

    def batch(s, micro, layout):
        if s == step:
            if release is not None:
                release.wait(30)
            raise error
        return real(s, micro, layout)
    stream.reader.batch = batch


def test_one_ranks_failed_read_is_reported_to_the_agreement_and_raised_at_its_step_by_every_rank(store, tmp_path):
    """Two ranks of one node, each assembling its own rows in the background: rank 1's read of
    step 3 fails. Before step 3 each answers the stop agreement's questions (still reading?
    failed? who?) without waiting; a wait for the read ends as soon as it ended, not at the
    timeout; once the agreement (here the MAX of the answers) named rank 1, rank 1 raises its own
    error at step 3 and rank 0 one naming rank 1, each marked to be printed by its rank."""
    from ds_trhash.data.stream.delivery import PeerReadError, PeerStoreUnavailable
    from ds_trhash.data.stream.delivery.exchange.chunk import FAILED, STORE_GONE

    streams = []
    for layout in LAYOUTS:
        cache = open_corpus(plan_for(store), str(store)).open_cache(tmp_path / f"cache-{layout.rank}", 100 * SHARD_BYTES)
        streams.append(RankStream(ReplayReader(plan_for(store), None, SEED, cache=cache), layout, end=STEPS))
    release = threading.Event()
    _failing_at(streams[1], 3, CacheError("shard a/shard-00001.bin: two downloads hashed x and y"), release)
    try:
        for stream in streams:
            stream.begin(0)
        for step in range(3):
            for stream in streams:
                stream.wait_read(step, 30)
                assert stream.readiness(step) == (0, 0, 0)
                stream.micro_batches(step)
        streams[0].wait_read(3, 30)
        assert streams[1].readiness(3) == (1, 0, 0)  # still reading (held until released)
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        streams[1].wait_read(3, 20)
        assert time.monotonic() - started < 5  # woken when the read ended, not at the timeout
        answers = [stream.readiness(3) for stream in streams]
        assert answers == [(0, 0, 0), (0, FAILED, 2)]
        agreed = [max(column) for column in zip(*answers)]
        for stream in streams:
            stream.agreed(3, agreed[1], agreed[2])
        with pytest.raises(PeerReadError, match=r"^rank 1 could not read its rows for step 3 \(its own error is in "
                                                r"its log\)$") as peer:
            streams[0].micro_batches(3)
        with pytest.raises(CacheError, match="two downloads hashed") as own:
            streams[1].micro_batches(3)
        assert peer.value.per_rank and own.value.per_rank and not isinstance(peer.value, PeerStoreUnavailable)
        streams[0].agreed(4, STORE_GONE, 2)  # the store stayed away: the others' error says so too
        with pytest.raises(PeerStoreUnavailable, match="rank 1 could not read its rows for step 4"):
            streams[0].micro_batches(4)
    finally:
        release.set()
        for stream in streams:
            stream.close()
    assert not assembly_threads()
