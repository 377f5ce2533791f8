"""Writing a checkpoint (checkpoints/save.py): layout, atomic publish, every rank into one
directory, a crash leaving nothing visible. The engine writer is a fake."""
import json
import threading

import pytest

from ds_trhash import checkpoints as ck
from ds_trhash.checkpoints import CheckpointError, find_resumable, list_checkpoints, rotate, verify
from ds_trhash.checkpoints.save import save_checkpoint
from tests.checkpoints.helpers import fake_engine, save, state


def test_layout_manifest_and_state(tmp_path):
    path = save(tmp_path, 20)
    assert path == tmp_path / "checkpoints" / "step_00000020"
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"latest", "state/mp_rank_00_model_states.pt", "trainer_state.json",
                                      "rng/rank_0.pt"}
    entry = manifest["files"]["state/mp_rank_00_model_states.pt"]
    assert entry["size"] == len(b"engine-bytes") and len(entry["sha256"]) == 64
    saved = json.loads((path / "trainer_state.json").read_text())
    assert saved["complete"] is True and saved["created"] and saved["step"] == 20 and saved["data_cursor"] == 160
    assert verify(path) == (True, "ok")
    assert not list((tmp_path / "checkpoints").glob("*.tmp*"))


def test_plain_dict_state_keeps_extra_keys_and_requires_the_typed_ones(tmp_path):
    doc = {**state(5).to_dict(), "tokens_seen": 640, "plan_doc": {"format": "x"}}
    path = save(tmp_path, 5, trainer_state=doc)
    saved = ck.read_trainer_state(path)
    assert saved["tokens_seen"] == 640 and saved["plan_doc"] == {"format": "x"} and saved["complete"] is True
    del doc["data_cursor"], doc["lora"]
    with pytest.raises(CheckpointError, match="lacks data_cursor, lora"):
        save(tmp_path, 5, trainer_state=doc)


def test_state_must_match_the_save(tmp_path):
    with pytest.raises(CheckpointError, match="says step 3.*for step 4"):
        save(tmp_path, 4, trainer_state=state(3))


def test_crash_leaves_no_checkpoint_and_the_tmp_is_cleaned_later(tmp_path):
    def crash(tmp):
        fake_engine()(tmp)
        raise RuntimeError("node lost")

    with pytest.raises(RuntimeError, match="node lost"):
        save(tmp_path, 30, write_engine_state=crash)
    root = tmp_path / "checkpoints"
    assert not (root / "step_00000030").exists()
    assert (root / "step_00000030.tmp").is_dir()
    assert list_checkpoints(tmp_path) == [] and find_resumable(tmp_path, log=lambda m: None) is None
    save(tmp_path, 30)  # the retry of the same step clears the stale attempt first
    assert verify(root / "step_00000030")[0]
    (root / "step_00000040.tmp").mkdir()
    rotate(tmp_path, keep_last=3, log=lambda m: None)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000030"]


def test_missing_rank_rng_state_is_not_published(tmp_path):
    with pytest.raises(CheckpointError, match=r"ranks \[1\] wrote no RNG state"):
        save(tmp_path, 7, world_size=2, trainer_state=state(7, world_size=2))
    assert not (tmp_path / "checkpoints" / "step_00000007").exists()


def test_two_ranks_write_into_one_directory(tmp_path):
    barrier = threading.Barrier(2)
    errors = []

    def rank_main(rank):
        def write(tmp):
            (tmp / f"engine_rank_{rank}.bin").write_bytes(bytes([rank]) * 10)
        try:
            save_checkpoint(tmp_path, 8, write_engine_state=write, trainer_state=state(8, world_size=2),
                            rank=rank, world_size=2, barrier=barrier.wait)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    files = json.loads((tmp_path / "checkpoints/step_00000008/MANIFEST.json").read_text())["files"]
    assert {"engine_rank_0.bin", "engine_rank_1.bin", "rng/rank_0.pt", "rng/rank_1.pt"} <= set(files)


def test_resaving_a_step_replaces_it_whole(tmp_path):
    save(tmp_path, 9, write_engine_state=fake_engine(b"old"))
    path = save(tmp_path, 9, write_engine_state=fake_engine(b"newer"))
    assert (path / "state/mp_rank_00_model_states.pt").read_bytes() == b"newer"
    assert verify(path)[0]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000009"]


def test_an_unhealthy_launch_publishes_nothing_and_keeps_the_last_checkpoint(tmp_path):
    """The publish guard (the launch's liveness): a rank lost, or this one frozen, refuses the
    rename; the last complete checkpoint stays the newest, untouched."""
    save(tmp_path, 3)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match=r"step_00000006.tmp was not published: rank 1 was lost \(silent\); "
                                              r"the last complete checkpoint stays the newest"):
        save(tmp_path, 6, may_publish=lambda: "rank 1 was lost (silent)")
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
            if p.is_file() and "step_00000006.tmp" not in p.parts} == before
    assert verify(list_checkpoints(tmp_path)[0].path, deep=True)[0]
