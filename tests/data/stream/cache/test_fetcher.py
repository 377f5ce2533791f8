"""The prefetch process: the same rows as direct reads, a bounded cache, a corrupt shard reported at
the next read, Ctrl-C ignored, gone with its rank, and prefetching in-process when it cannot start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
import time

import pytest
import torch

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.cache import ShardIntegrityError, files as cf
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.data.stream.delivery import ReplayReader
from tests.data.hub_corpus import SHARD_BYTES, plan_for, write_corpus

REPO_ROOT = str(Path(__file__).resolve().parents[4])


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z":  # exited, not yet reaped
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_rows_through_the_prefetch_process_equal_direct_reads_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    root = write_corpus(tmp_path / "store")
    doc = plan_for(root)
    limit = 4 * SHARD_BYTES
    cache = open_corpus(doc, str(root)).open_cache(tmp_path / "cache", limit, prefetch=2, fetch_process=True)
    cached, direct = ReplayReader(doc, None, seed=5, cache=cache, shuffle_window=8), ReplayReader(doc, root, seed=5, shuffle_window=8)
    layout = BatchLayout(micro_batch=4, grad_accum=1, rank=0, world_size=1)
    for step in range(direct.num_rows // 4):
        a, b = cached.batch(step, 0, layout), direct.batch(step, 0, layout)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert cf.scan(tmp_path / "cache")[0] <= limit
        assert cache.wait_idle(30)  # every read after the first finds its shards prefetched
    worker = cache.prefetch_pid
    assert b"fetch_worker" in open(f"/proc/{worker}/cmdline", "rb").read()
    environ = open(f"/proc/{worker}/environ", "rb").read().split(b"\0")
    assert not [v for v in environ if v.split(b"=")[0] in (b"RANK", b"LOCAL_RANK")]  # not a rank (ops.jobs.ranks)
    counts = cache.counters()
    assert counts["prefetched"] > 0 and counts["downloaded_bytes"] >= counts["prefetched"] * SHARD_BYTES
    assert counts["evictions"] > 0 and counts["misses"] <= 2  # 12 shards through a bound of 4
    cached.close()
    cache.close()
    assert gone(worker)


def test_a_corrupt_shard_met_by_the_prefetch_process_stops_the_next_read(tmp_path):
    root = write_corpus(tmp_path / "store")
    doc = plan_for(root)
    bad = root / "a" / "shard-00001.bin"
    bad.write_bytes(bytes(reversed(bad.read_bytes())))  # same size, other bytes
    cache = open_corpus(doc, str(root)).open_cache(tmp_path / "cache", 10 * SHARD_BYTES, fetch_process=True)
    cache.prefetch([("a", "shard-00001.bin")])
    assert cache.wait_idle(30)
    with pytest.raises(ShardIntegrityError, match="a/shard-00001.bin"):
        cache.get("a", "shard-00000.bin")
    assert not list((tmp_path / "cache").rglob("shard-00001.bin*.partial-*"))
    assert not [p for p in (tmp_path / "cache").rglob("shard-00001.bin") if p.is_file()]
    cache.close()


def test_a_store_that_cannot_travel_is_prefetched_in_process(tmp_path, capfd):
    root = write_corpus(tmp_path / "store")
    doc = plan_for(root)
    corpus = open_corpus(doc, str(root))
    corpus.store.not_picklable = lambda: None
    cache = corpus.open_cache(tmp_path / "cache", 10 * SHARD_BYTES, fetch_process=True)
    cache.prefetch([("b", "shard-00003.bin")])
    assert cache.wait_idle(30) and cache.counters()["prefetched"] == 1
    assert "shard prefetches now run in the reading process" in capfd.readouterr().err
    assert cache.prefetch_pid is None  # no process
    cache.close()


RANK = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from ds_trhash.data.stream.corpus.opening import open_corpus
    from tests.data.hub_corpus import plan_for
    root, cache_dir = Path(sys.argv[1]), Path(sys.argv[2])
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGUSR1, lambda *_: None)  # a rank records the time-limit warning
    cache = open_corpus(plan_for(root), str(root)).open_cache(cache_dir, 1 << 30, fetch_process=True)
    cache.prefetch([("a", "shard-00000.bin")])
    assert cache.wait_idle(30)
    print(cache.prefetch_pid, flush=True)
    while not stop:
        time.sleep(0.05)
    # still there after the group's SIGUSR1 and Ctrl-C (running, not a zombie the rank has not reaped)
    assert open(f"/proc/{cache.prefetch_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    print("worker alive after Ctrl-C", flush=True)
    cache.close()
    print("closed", flush=True)
    time.sleep(60)
""")


def test_the_prefetch_process_ignores_ctrl_c_and_sigusr1_and_goes_with_its_rank(tmp_path):
    root = write_corpus(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(root), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        worker = int(rank.stdout.readline())
        os.killpg(rank.pid, signal.SIGUSR1)  # as a SLURM step's time-limit warning does: every process
        time.sleep(0.2)
        os.killpg(rank.pid, signal.SIGINT)  # as the terminal does: the whole group
        assert rank.stdout.readline().strip() == "worker alive after Ctrl-C"
        assert rank.stdout.readline().strip() == "closed"
        assert gone(worker)
    finally:
        rank.kill()
        rank.wait()


def test_the_prefetch_process_exits_when_its_rank_is_killed(tmp_path):
    root = write_corpus(tmp_path / "store")
    script = RANK.replace("while not stop:", "while True:")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    rank = subprocess.Popen([sys.executable, "-c", script, str(root), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                            text=True, env=env, cwd=REPO_ROOT, start_new_session=True)
    worker = int(rank.stdout.readline())
    rank.kill()
    rank.wait()
    assert gone(worker)


FLOOD = textwrap.dedent("""
    import os, pickle, sys
    from multiprocessing.connection import Connection
    conn = Connection(int(sys.argv[1]))
    count = pickle.loads(conn.recv_bytes())["count"]
    for i in range(count):  # answers of about 20 kB: each takes several reads of the socket
        conn.send(("filled", ("a", f"shard-{i:05d}.bin"), True, {"hits": 1, "pad": "x" * 20000}, None))
    while True:  # read what the rank wants until it shuts the connection
        try:
            conn.recv()
        except (EOFError, OSError):
            break
""")


def test_threads_that_poll_and_send_at_once_each_get_whole_answers(monkeypatch):
    """The training thread (figures), the exchange's thread and the assembly thread all speak to
    one prefetch process: against a worker that floods answers, four threads polling and sending
    at once read every answer once, whole (two readers of one pipe read halves of messages)."""
    import threading

    from ds_trhash.data.stream.cache import fetcher as fetcher_module

    def start(theirs):
        return subprocess.Popen([sys.executable, "-c", FLOOD, str(theirs.fileno())], pass_fds=(theirs.fileno(),))

    monkeypatch.setattr(fetcher_module, "_start", start)
    count = 3000
    fetcher = fetcher_module.Fetcher({"count": count})
    seen, errors = [], []

    def poll(sends: bool) -> None:
        try:
            while len(seen) < count and not errors:
                if sends:
                    fetcher.want((("a", f"shard-{len(seen) % 7:05d}.bin"),))
                seen.extend(key for key, *_ in fetcher.answers())
        except Exception as exc:  # noqa: BLE001 (what the test looks for)
            errors.append(exc)

    threads = [threading.Thread(target=poll, args=(n % 2 == 0,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    fetcher.close()
    assert not errors, errors
    assert sorted(seen) == [("a", f"shard-{i:05d}.bin") for i in range(count)]
    with pytest.raises(fetcher_module.FetcherGone):  # closed: no thread reads a closed pipe
        fetcher.answers()
