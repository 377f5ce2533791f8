"""How a reader checks an export (ds_trhash/release/export/manifest.py): ``verify_export`` passes a
complete export and names what is wrong with an incomplete or corrupt one, in-process, on a
hand-made export (no model needed)."""
import json

import pytest

from ds_trhash.io import sha256_file
from ds_trhash.release.export.manifest import EXPORT_FORMAT, EXPORT_MANIFEST, WEIGHTS, export_files, verify_export


def _export(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / WEIGHTS).write_bytes(b"weights" * 30)
    (out / "config.json").write_text("{}")
    entry = lambda p: {"sha256": sha256_file(p), "size": p.stat().st_size}  # noqa: E731
    manifest = {"format": EXPORT_FORMAT, "weights": {"file": WEIGHTS, **entry(out / WEIGHTS)},
                "files": {"config.json": entry(out / "config.json")}}
    (out / EXPORT_MANIFEST).write_text(json.dumps(manifest))
    return out, manifest


def test_a_complete_export_verifies_and_lists_its_weights_with_its_files(tmp_path):
    out, manifest = _export(tmp_path)
    assert verify_export(out) == (True, "ok")
    assert export_files(manifest) == {WEIGHTS: {"sha256": sha256_file(out / WEIGHTS), "size": 210},
                                      "config.json": manifest["files"]["config.json"]}


def test_an_export_without_a_usable_manifest_is_incomplete(tmp_path):
    out, _ = _export(tmp_path)
    (out / EXPORT_MANIFEST).write_text(json.dumps({"format": EXPORT_FORMAT, "files": {}}))  # no "weights"
    ok, reason = verify_export(out)
    assert not ok and reason.startswith("incomplete (")
    (out / EXPORT_MANIFEST).unlink()
    missing = f"{out / EXPORT_MANIFEST} is missing; {out} is not a complete export"
    assert verify_export(out) == (False, f"incomplete ({missing})")


def test_files_beside_or_missing_from_the_manifest_make_it_corrupt(tmp_path):
    out, _ = _export(tmp_path)
    (out / "notes.txt").write_text("left by hand")
    (out / "config.json").unlink()
    ok, reason = verify_export(out)
    assert not ok and reason == (f"corrupt (files differ from {EXPORT_MANIFEST}: missing ['config.json'], "
                                 "unlisted ['notes.txt'])")


@pytest.mark.parametrize("deep", [True, False])
def test_a_changed_file_is_caught_by_size_always_and_by_hash_when_deep(tmp_path, deep):
    out, _ = _export(tmp_path)
    data = bytearray((out / WEIGHTS).read_bytes())
    data[5] ^= 1  # same size, other bytes
    (out / WEIGHTS).write_bytes(bytes(data))
    expected = (False, f"corrupt ({WEIGHTS} SHA-256 differs from {EXPORT_MANIFEST})") if deep else (True, "ok")
    assert verify_export(out, deep=deep) == expected
    (out / WEIGHTS).write_bytes(bytes(data) + b"x")
    assert verify_export(out, deep=deep) == (False, f"corrupt ({WEIGHTS} has 211 bytes, the manifest says 210)")
