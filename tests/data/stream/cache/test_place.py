"""Where the node's cache may live: node-local by default, its own folder only, no network filesystem."""
import pytest

from ds_trhash.data.stream.cache import CacheError
from ds_trhash.data.stream.cache import CACHE_MARKER, cache_dir_of, check_cache_place, claim, default_cache_dir, filesystem_type
from tests.fail_closed import tree_digest


def _mounts(tmp_path, *lines):
    path = tmp_path / "mounts"
    path.write_text("".join(f"{line}\n" for line in lines))
    return str(path)


def test_the_default_is_node_local_scratch_one_per_user(monkeypatch, tmp_path):
    import os

    monkeypatch.delenv("DS_TRHASH_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert default_cache_dir() == tmp_path / f"ds-trhash-{os.getuid()}" / "shard_cache"
    monkeypatch.setenv("DS_TRHASH_CACHE_DIR", "/scratch/cache")
    assert cache_dir_of(None) == default_cache_dir() == type(tmp_path)("/scratch/cache")
    assert cache_dir_of("/elsewhere") == type(tmp_path)("/elsewhere")


def test_a_folder_holding_a_users_files_is_refused_naming_one(tmp_path):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "precious.txt").write_text("mine")
    before = tree_digest(tmp_path)
    with pytest.raises(CacheError, match=r"data.cache_dir .*cache already holds files the shard cache did not write "
                                         r"\(for example .*precious.txt\)"):
        check_cache_place(folder, "data.cache_dir", network_ok=False)
    assert tree_digest(tmp_path) == before
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheError, match="data.cache_dir .*file is a file"):
        check_cache_place(tmp_path / "file", "data.cache_dir", network_ok=False)


def test_the_caches_own_folder_is_accepted_marked_or_of_its_layout(tmp_path):
    claim(tmp_path / "new")
    assert (tmp_path / "new" / CACHE_MARKER).is_file()
    (tmp_path / "new" / "precious.txt").write_text("placed later: the scan never counts or evicts it")
    check_cache_place(tmp_path / "new", "data.cache_dir", network_ok=False)
    older = tmp_path / "older"  # a cache written before folders were marked: per-store folders only
    (older / "0123456789abcdef" / "web").mkdir(parents=True)
    (older / "0123456789abcdef" / "web" / "s.bin").write_bytes(b"x")
    check_cache_place(older, "data.cache_dir", network_ok=False)
    check_cache_place(tmp_path / "missing" / "cache", "data.cache_dir", network_ok=False)


@pytest.mark.parametrize("kind", ["nfs", "nfs4", "lustre", "gpfs", "cifs", "fuse.sshfs", "fuse"])
def test_a_network_filesystem_is_refused_unless_vouched_for(tmp_path, kind):
    mounts = _mounts(tmp_path, "/dev/vda / ext4 rw 0 0", f"server:/x {tmp_path} {kind} rw 0 0")
    assert filesystem_type(tmp_path / "cache" / "deeper", mounts) == kind
    with pytest.raises(CacheError, match=rf"data.cache_dir .* is on a {kind} filesystem, where file locks are not "
                                         r"reliable.*data.cache_on_network_fs: true"):
        check_cache_place(tmp_path / "cache", "data.cache_dir", network_ok=False, mounts=mounts)
    check_cache_place(tmp_path / "cache", "data.cache_dir", network_ok=True, mounts=mounts)


def test_local_filesystems_pass(tmp_path):
    mounts = _mounts(tmp_path, "/dev/vda / ext4 rw 0 0", f"tmpfs {tmp_path} tmpfs rw 0 0")
    assert filesystem_type(tmp_path, mounts) == "tmpfs"
    check_cache_place(tmp_path / "cache", "data.cache_dir", network_ok=False, mounts=mounts)
