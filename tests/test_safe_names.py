"""Names read from untrusted files: bare names, relative paths, and no symlink leading out."""

import os

import pytest

from ds_trhash.errors import UserError
from ds_trhash.safe_names import UnsafeNameError, bare_name, relative_path, resolve_under


@pytest.mark.parametrize("name, why", [
    ("../victim.bin", "directory part"), ("a/b.bin", "directory part"), ("/etc/passwd", "absolute"),
    ("..", "names a folder"), (".", "names a folder"), ("", "empty"), ("  ", "empty"), ("a\x00b", "NUL"),
    ("a\\b", "backslash"), ("C:x", "absolute"), (3, "must be a string"), (None, "must be a string"),
])
def test_bare_name_refuses_everything_but_a_plain_name(name, why):
    with pytest.raises(UnsafeNameError, match=why) as info:
        bare_name(name, "plan.json", "phases[0].file")
    assert "plan.json field 'phases[0].file'" in str(info.value) and isinstance(info.value, UserError)


def test_plain_names_pass_unchanged():
    assert bare_name("tokens-00000.bin", "m") == "tokens-00000.bin"
    assert bare_name("a..b", "m") == "a..b"  # dots inside a name are not a parent reference
    assert relative_path("train/labels.bin", "m") == "train/labels.bin"


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/abs", "a//b", "./a", "a/", ""])
def test_relative_path_refuses_parents_absolutes_and_odd_parts(name):
    with pytest.raises(UnsafeNameError):
        relative_path(name, "MANIFEST.json", "files")


def test_resolve_under_refuses_a_symlink_leading_out_and_allows_one_inside(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "src").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim.bin").write_bytes(b"secret")
    (root / "src" / "real.bin").write_bytes(b"ok")
    os.symlink(outside / "victim.bin", root / "src" / "out.bin")
    os.symlink(root / "src" / "real.bin", root / "src" / "in.bin")
    os.symlink(outside, root / "linkdir")
    assert resolve_under(root, "src/in.bin", "m") == root / "src" / "in.bin"
    assert resolve_under(root, "src/missing.bin", "m") == root / "src" / "missing.bin"  # reported by the caller
    for name in ("src/out.bin", "linkdir/victim.bin"):
        with pytest.raises(UnsafeNameError, match="outside"):
            resolve_under(root, name, "manifest.json", "shards[0].file")
    with pytest.raises(UnsafeNameError, match="'..' part"):
        resolve_under(root, "../outside/victim.bin", "m")
