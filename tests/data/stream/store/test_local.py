import pytest

from ds_trhash.data.stream.store import LOCAL_COMMIT, LocalStore, StoreError


def test_listing_reading_and_copying(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text('{"k": 1}')
    (tmp_path / "a" / "s.bin").write_bytes(b"12345")
    store = LocalStore(tmp_path)
    assert store.resolve() == LOCAL_COMMIT
    assert {p: f.size for p, f in store.list_files().items()} == {"a/manifest.json": 8, "a/s.bin": 5}
    assert store.read_json("a/manifest.json") == {"k": 1}
    dest = tmp_path / "out"
    dest.write_bytes(b"\0" * 9)
    store.download("a/s.bin", dest, 5)
    assert dest.read_bytes() == b"12345"


def test_refusals_name_the_file(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(StoreError, match="missing; run `ds-trhash data tokenize`"):
        store.read_json("a/manifest.json")
    (tmp_path / "bad.json").write_bytes(b"\xff{")
    with pytest.raises(StoreError, match="bad.json is not valid UTF-8 JSON"):
        store.read_json("bad.json")
    (tmp_path / "link.json").symlink_to(tmp_path.parent / "elsewhere.json")
    with pytest.raises(StoreError, match="leads outside the store"):
        store.read_json("link.json")
    with pytest.raises(StoreError, match="not a plain relative file name"):
        store.read_json("../x.json")
    with pytest.raises(StoreError, match="is not a directory"):
        LocalStore(tmp_path / "nope").resolve()
