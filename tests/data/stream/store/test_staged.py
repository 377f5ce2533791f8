"""Nodes sharing one download per shard through a staging folder (the two-node launch: test_multinode)."""
import hashlib
import multiprocessing as mp

from ds_trhash.data.stream.store import LocalStore
from ds_trhash.data.stream.store.staged import StagedStore


class Counting(LocalStore):
    """A store that counts its downloads in a file (appends are atomic across processes)."""

    log = None

    def download(self, path, dest, size):
        with open(self.log, "a") as f:
            f.write(path + "\n")
        return super().download(path, dest, size)


def _node(root, staging, node, nodes, log, names, out):
    Counting.log = log
    store = StagedStore(Counting(root), staging, node, nodes,
                        expected={n: hashlib.sha256((root / n).read_bytes()).hexdigest() for n in names})
    for name in names:
        dest = out / f"node{node}-{name}"
        dest.write_bytes(b"")
        assert store.download(name, dest, (root / name).stat().st_size) == hashlib.sha256(dest.read_bytes()).hexdigest()


def test_four_nodes_download_each_file_once_and_leave_nothing_staged(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    names = [f"s{i}.bin" for i in range(6)]
    for i, name in enumerate(names):
        (root / name).write_bytes(bytes([i]) * (1000 + i))
    log, out, staging = tmp_path / "log", tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_node, args=(root, staging, n, 4, log, names, out)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sorted(log.read_text().split()) == sorted(names)  # one download per file for all four nodes
    for n in range(4):
        for name in names:
            assert (out / f"node{n}-{name}").read_bytes() == (root / name).read_bytes()
    assert not [p for p in staging.rglob("*") if p.is_file()]  # every node took each: nothing left


def test_a_corrupt_staged_copy_is_dropped_and_fetched_again(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    (root / "s.bin").write_bytes(b"good" * 100)
    expected = {"s.bin": hashlib.sha256(b"good" * 100).hexdigest()}
    Counting.log = tmp_path / "log"
    first = StagedStore(Counting(root), tmp_path / "staging", 0, 2, expected=expected)
    dest = tmp_path / "a"
    dest.write_bytes(b"")
    first.download("s.bin", dest, 400)
    staged = next(p for p in (tmp_path / "staging").rglob("s.bin"))
    staged.write_bytes(b"evil" * 100)  # the shared copy goes bad before node 1 takes it
    second = StagedStore(Counting(root), tmp_path / "staging", 1, 2, expected=expected)
    dest = tmp_path / "b"
    dest.write_bytes(b"")
    assert second.download("s.bin", dest, 400) == expected["s.bin"] and dest.read_bytes() == b"good" * 100
    assert (tmp_path / "log").read_text().split() == ["s.bin", "s.bin"]  # fetched again from the store
