"""The run directory the Hub sync tests upload (three complete checkpoints and an export) and
the checks they share, for tests/release/test_hub*.py."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ds_trhash.checkpoints import list_checkpoints
from ds_trhash.checkpoints.save import save_checkpoint
from ds_trhash.checkpoints.sync_guard import LOCK_FILE, VERIFIED_FILE
from ds_trhash.io import sha256_file

REPO = "me/run"
UNITS = ["checkpoints/step_00000010", "checkpoints/step_00000020", "checkpoints/step_00000030", "export"]


def checkpoint_state(step):
    """A trainer state a checkpoint at ``step`` of a one-rank pretraining run may hold."""
    return dict(stage="pretraining", step=step, epoch=0, data_cursor=0, world_size=1, training_critical={},
                plan_fingerprint=None, plan_sha256=None, backends_used={"experts": "pytorch"}, lora=False,
                family="language")


def engine_writer(payload):
    """Writes one rank's engine state of ``payload`` bytes (an LFS-tracked .pt on the Hub)."""
    def write(tmp):
        (tmp / "state").mkdir()
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(payload)
    return write


def make_run(tmp_path, steps=(10, 20, 30)):
    """A run directory: three complete checkpoints (an LFS-tracked .pt, regular JSON) and an export."""
    out = tmp_path / "run"
    for step in steps:
        save_checkpoint(out, step, write_engine_state=engine_writer(b"weights-%d" % step * 50),
                        trainer_state=checkpoint_state(step), rank=0, world_size=1)
    exp = out / "export"
    exp.mkdir()
    (exp / "model.safetensors").write_bytes(b"final weights" * 40)
    (exp / "config.json").write_text("{}")
    entry = lambda p: {"sha256": sha256_file(p), "size": p.stat().st_size}  # noqa: E731
    (exp / "export_manifest.json").write_text(json.dumps({
        "format": "ds-trhash-export-v1", "weights": {"file": "model.safetensors", **entry(exp / "model.safetensors")},
        "files": {"config.json": entry(exp / "config.json")}}))
    return out


def steps_of(out):
    return [c.step for c in list_checkpoints(out)]


def tree_digest(root: Path) -> str:
    """Every checkpoint and export byte (the sync's own lock and verified record aside)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (LOCK_FILE, VERIFIED_FILE)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def quiet(line):
    pass


def assert_remote_equals_local(srv, out, unit):
    remote = {p[len(unit) + 1:]: f for p, f in srv.repo(REPO).files.items() if p.startswith(unit + "/")}
    local = {p.relative_to(out / unit).as_posix(): p.read_bytes() for p in (out / unit).rglob("*") if p.is_file()}
    assert {k: f.data for k, f in remote.items()} == local
    assert {k for k, f in remote.items() if f.lfs} == {k for k in local if k.endswith((".pt", ".safetensors"))}
