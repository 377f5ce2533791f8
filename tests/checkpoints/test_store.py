"""The crash-safe store: manifests, verification, listing, rotation (writing: test_save.py).
The engine writer is a fake."""
import json

import pytest

from ds_trhash.checkpoints import (
    CheckpointError,
    find_resumable,
    list_checkpoints,
    rotate,
    verify,
)
from tests.checkpoints.helpers import messages, save


# --------------------------------------------------------------------------- verification


def test_verify_detects_every_kind_of_damage(tmp_path):
    path = save(tmp_path, 1)
    weights = path / "state/mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[:-1])
    ok, reason = verify(path)
    assert not ok and reason == "corrupt (state/mp_rank_00_model_states.pt has 11 bytes, MANIFEST.json says 12)"

    weights.write_bytes(b"ENGINE-bytes")  # same size, other bytes: only the hash sees it
    assert verify(path, deep=False) == (True, "ok")
    assert verify(path) == (False, "corrupt (state/mp_rank_00_model_states.pt SHA-256 differs from MANIFEST.json)")

    weights.write_bytes(b"engine-bytes")
    (path / "stray.txt").write_text("x")
    assert verify(path) == (False, "corrupt (stray.txt not listed in MANIFEST.json)")
    (path / "stray.txt").unlink()
    (path / "rng/rank_0.pt").unlink()
    assert verify(path) == (False, "corrupt (rng/rank_0.pt listed in MANIFEST.json but missing)")
    (path / "MANIFEST.json").unlink()
    assert verify(path) == (False, "incomplete (MANIFEST.json missing)")


def test_verify_refuses_a_manifest_naming_files_outside_the_checkpoint(tmp_path):
    path = save(tmp_path, 1)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    for name, needle in (("../../victim.pt", "'..' part"), ("/etc/passwd", "absolute path")):
        changed = dict(manifest, files={**manifest["files"], name: {"size": 1, "sha256": "0" * 64}})
        (path / "MANIFEST.json").write_text(json.dumps(changed))
        ok, reason = verify(path)
        assert not ok and reason.startswith("corrupt (") and needle in reason and "field 'files'" in reason
    (path / "MANIFEST.json").write_text(json.dumps(dict(manifest, files={"trainer_state.json": "12 bytes"})))
    assert verify(path) == (False, "corrupt (MANIFEST.json 'files' is not an object of {size, sha256} entries)")


def test_find_resumable_skips_truncated_and_manifestless_newer_ones(tmp_path):
    for step in (10, 20, 30, 40):
        save(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_00000040/MANIFEST.json").unlink()
    f = root / "step_00000030/state/mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:-1])
    lines, log = messages()
    info = find_resumable(tmp_path, log=log)
    assert info.step == 20 and info.path == root / "step_00000020"
    assert lines == [
        "step_00000040 is incomplete (MANIFEST.json missing) — falling back to step_00000020",
        "step_00000030 is corrupt (state/mp_rank_00_model_states.pt has 11 bytes, MANIFEST.json says 12)"
        " — falling back to step_00000020",
    ]


def test_find_resumable_says_when_nothing_is_left(tmp_path):
    path = save(tmp_path, 10)
    (path / "MANIFEST.json").unlink()
    lines, log = messages()
    assert find_resumable(tmp_path, log=log) is None
    assert lines == ["step_00000010 is incomplete (MANIFEST.json missing) — no complete checkpoint left to fall back to"]


# --------------------------------------------------------------------------- rotation


def test_rotation_keeps_newest_protected_and_incomplete(tmp_path):
    for step in (10, 20, 30, 40, 50, 60):
        save(tmp_path, step)
    root = tmp_path / "checkpoints"
    (root / "step_00000030/MANIFEST.json").unlink()
    (root / "step_00000070.tmp").mkdir()
    lines, log = messages()
    removed = rotate(tmp_path, keep_last=2, protect={20}, log=log)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000020", "step_00000030", "step_00000050",
                                                      "step_00000060"]
    assert {p.name for p in removed} == {"step_00000070.tmp", "step_00000010", "step_00000040"}
    assert any("left step_00000030 in place" in line for line in lines)


def test_rotation_never_deletes_the_newest_verified_one(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    newest = tmp_path / "checkpoints/step_00000030/state/mp_rank_00_model_states.pt"
    newest.write_bytes(b"x")  # damaged: the newest good one is now step 20
    rotate(tmp_path, keep_last=1, log=lambda m: None)
    assert [c.step for c in list_checkpoints(tmp_path)] == [20, 30]
    with pytest.raises(CheckpointError, match="keep_last must be >= 1"):
        rotate(tmp_path, keep_last=0)
