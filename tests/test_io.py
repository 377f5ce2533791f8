"""ds_trhash.io: hashing, fsync, atomic JSON and directory publishing, each on real files."""
import hashlib
import json
import os

import pytest

from ds_trhash import io


def test_sha256_file_matches_hashlib_across_chunk_boundaries(tmp_path):
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "blob"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert io.sha256_file(path) == expected
    assert io.sha256_file(path, chunk_bytes=1024) == expected  # several chunks and a short tail
    (tmp_path / "empty").write_bytes(b"")
    assert io.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_fsync_helpers_accept_files_directories_and_trees(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    io.fsync_path(tmp_path / "a" / "b" / "f")
    io.fsync_path(tmp_path / "a")
    io.fsync_tree(tmp_path)
    with pytest.raises(FileNotFoundError):
        io.fsync_path(tmp_path / "missing")


def test_write_json_layout(tmp_path):
    io.write_json(tmp_path / "sorted.json", {"b": 1, "a": [1, 2]})
    assert (tmp_path / "sorted.json").read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    io.write_json(tmp_path / "ordered.json", {"b": 1, "a": 2}, sort_keys=False, fsync=False)
    assert (tmp_path / "ordered.json").read_text() == '{\n  "b": 1,\n  "a": 2\n}\n'


def test_write_json_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "doc.json"
    io.write_json_atomic(out, {"v": 1})
    io.write_json_atomic(out, {"v": 2})
    assert json.loads(out.read_text()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_write_json_atomic_failure_keeps_the_old_file(tmp_path):
    out = tmp_path / "doc.json"
    io.write_json_atomic(out, {"v": 1})
    before = out.read_bytes()
    with pytest.raises(TypeError):
        io.write_json_atomic(out, {"v": object()})  # not serialisable: fails before the rename
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_publish_dir_new_and_replacing(tmp_path):
    tmp, final = tmp_path / "x.tmp", tmp_path / "x"
    tmp.mkdir()
    (tmp / "f").write_text("one")
    io.publish_dir(tmp, final)
    assert _tree(final) == {"f": b"one"} and not tmp.exists()
    tmp.mkdir()
    (tmp / "g").write_text("two")
    io.publish_dir(tmp, final)  # the old copy is swapped out whole, then deleted
    assert _tree(final) == {"g": b"two"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_publish_dir_without_replace_refuses_a_non_empty_target(tmp_path):
    tmp, final = tmp_path / "x.tmp", tmp_path / "x"
    tmp.mkdir()
    (tmp / "new").write_text("new")
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(OSError):
        io.publish_dir(tmp, final, replace=False)
    assert _tree(final) == {"old": b"old"} and _tree(tmp) == {"new": b"new"}


def test_remove_dir_goes_through_a_tmp_name(tmp_path):
    target = tmp_path / "step_00000001"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "f").write_text("x")
    io.remove_dir(target)
    assert list(tmp_path.iterdir()) == []


def test_os_errors_as_turns_a_path_error_into_the_given_refusal_and_leaves_others_alone(tmp_path):
    class Refused(Exception):
        pass

    @io.os_errors_as(Refused)
    def read(path):
        return open(path).read()

    with pytest.raises(Refused, match="No such file or directory") as caught:
        read(tmp_path / "missing.txt")
    assert str(tmp_path / "missing.txt") in str(caught.value)
    with pytest.raises(OSError, match="no path here"), io.os_errors_as(Refused):
        raise OSError("no path here")  # names no file: not about the user's input, keeps its type
    with pytest.raises(ValueError), io.os_errors_as(Refused):
        raise ValueError("a bug")
