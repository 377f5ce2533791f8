import fcntl
import os

import pytest

from ds_trhash.data.stream.cache import files as cf


def test_entry_paths_stay_inside_the_cache(tmp_path):
    assert cf.entry_path(tmp_path, "web", "tokens-00000.bin") == tmp_path / "web" / "tokens-00000.bin"
    for source, file in [("..", "x"), ("web", "../x"), ("web", "a/b"), ("web", "x.pin"), ("web", "x.hold"),
                         ("web", "x.partial-1")]:
        with pytest.raises(cf.CacheError, match="not a bare file name"):
            cf.entry_path(tmp_path, source, file)
    (tmp_path / "out").symlink_to(tmp_path.parent)
    with pytest.raises(cf.CacheError, match="outside the cache directory"):
        cf.entry_path(tmp_path, "out", "x.bin")


def test_a_marker_vouches_only_for_the_file_it_describes(tmp_path):
    final = tmp_path / "s" / "f.bin"
    final.parent.mkdir()
    partial = cf.side(final, ".partial-1-2")
    partial.write_bytes(b"abcd")
    cf.write_marker(partial, final, "h", 4)
    os.replace(partial, final)
    assert cf.trusted(final, "h", 4) and not cf.trusted(final, "other", 4)
    os.utime(final, ns=(1, 1))
    assert not cf.trusted(final, "h", 4)


def test_a_held_entry_cannot_be_evicted(tmp_path):
    entry = tmp_path / "s" / "f.bin"
    entry.parent.mkdir()
    entry.write_bytes(b"x")
    with cf.held(entry):
        assert not cf.try_evict(entry) and entry.exists()
    assert cf.try_evict(entry) and not entry.exists()
    fd = os.open(cf.side(entry, cf.HOLD), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the hold file is kept (never unlinked under a reader)
    os.close(fd)


def test_scan_counts_entries_and_partials_and_drops_stale_partials(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "s" / ("a.bin" + cf.MARKER)).write_text("{}")  # an entry of the cache: it wrote a marker
    (tmp_path / "s" / "b.bin.partial-99-1").write_bytes(b"y" * 7)  # no live downloader holds b's lock
    live = cf.download_lock(tmp_path / "s" / "c.bin")
    with live:
        (tmp_path / "s" / "c.bin.partial-98-1").write_bytes(b"z" * 5)
        used, entries = cf.scan(tmp_path)
    assert used == 15 and [p.name for _, p in entries] == ["a.bin"]
    assert not (tmp_path / "s" / "b.bin.partial-99-1").exists()


def test_a_measuring_scan_counts_a_stale_partial_and_leaves_it(tmp_path):
    """prune=False (an observer sampling the bound) deletes nothing and takes no download lock:
    it must not remove what a killed run left before a later run has looked at it."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.bin").write_bytes(b"x" * 10)
    (tmp_path / "s" / ("a.bin" + cf.MARKER)).write_text("{}")  # an entry of the cache: it wrote a marker
    stale = tmp_path / "s" / "b.bin.partial-99-1"
    stale.write_bytes(b"y" * 7)
    used, entries = cf.scan(tmp_path, prune=False)
    assert used == 17 and [p.name for _, p in entries] == ["a.bin"] and stale.exists()
    assert not (tmp_path / "s" / "b.bin.lock").exists()  # no lock was taken (nor created) for it
    assert cf.scan(tmp_path)[0] == 10 and not stale.exists()


def test_a_file_the_cache_did_not_write_is_never_counted_or_evicted(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "precious.txt").write_bytes(b"p" * 50)  # no verified marker beside it: not the cache's
    (tmp_path / "s" / "notes.partial-draft").write_bytes(b"q" * 5)  # not a partial of the cache's naming
    used, entries = cf.scan(tmp_path)
    assert used == 0 and entries == []
    assert (tmp_path / "precious.txt").read_bytes() == b"p" * 50 and (tmp_path / "s" / "notes.partial-draft").exists()


def test_each_store_and_commit_has_a_folder_of_its_own_under_the_cache(tmp_path):
    """A commit that moved, or another store, never finds the other's entries; the same pair
    always finds its own (a later run adopts them)."""
    root = cf.cache_root(tmp_path, "hf:http://hub/datasets/team/corpus", "abc")
    assert root.parent == tmp_path and len(root.name) == 16 and int(root.name, 16) >= 0
    assert root == cf.cache_root(tmp_path, "hf:http://hub/datasets/team/corpus", "abc")
    assert root != cf.cache_root(tmp_path, "hf:http://hub/datasets/team/corpus", "abd")
    assert root != cf.cache_root(tmp_path, "local:/data/corpus", "abc")
