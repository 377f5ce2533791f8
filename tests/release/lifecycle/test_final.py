"""final/ and stage_complete.json at the end of a completed stage (release/lifecycle/final.py and the
launch's last callback, release/lifecycle/finish.py), on run directories built without a launch; the
launches themselves are in test_lifecycle_launch.py."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_trhash.checkpoints import list_checkpoints, step_dir_name
from ds_trhash.checkpoints.weights import load_weights_only
from ds_trhash.release.export.writer import EXPORT_MANIFEST, WEIGHTS, verify_export
from ds_trhash.release.lifecycle.final import (
                                               COMPLETE_FILE,
                                               FINAL_DIR,
                                               export_final_enabled,
                                               final_status,
                                               read_completion,
                                               )
from ds_trhash.release.lifecycle.finish import write_final
from ds_trhash.run import StageEndCallback
from ds_trhash.training import config as tcfg
from ds_trhash.training.preparation.checks import resolve_init_checkpoint
from tests.release.run_fixtures import TOTAL, make_run, tiny_state, tree_digest, write_step

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("final") / "run")


def _ckpt(run, step):
    return run / "checkpoints" / step_dir_name(step)


def _quiet(_):
    pass


def test_final_is_a_verified_export_of_the_last_checkpoint_and_the_next_stage_can_start_from_it(finished_run):
    ok, why = final_status(finished_run, _ckpt(finished_run, TOTAL))
    assert ok, why
    assert verify_export(finished_run / FINAL_DIR) == (True, "ok")
    done = read_completion(finished_run)
    assert done["step"] == TOTAL and done["checkpoint"] == f"checkpoints/{step_dir_name(TOTAL)}"
    assert done["final_manifest_sha256"] is not None
    # --init-checkpoint RUN/final: an export is a weights-only source with the stage it came from
    assert resolve_init_checkpoint(finished_run / FINAL_DIR, log=_quiet) == str(finished_run / FINAL_DIR)
    weights, record = load_weights_only(finished_run / FINAL_DIR)
    source, _ = load_weights_only(_ckpt(finished_run, TOTAL))
    assert record.stage.value == "pretraining"
    assert set(weights) >= {k for k in source if not k.endswith("inv_freq")}
    for name, tensor in source.items():
        assert torch.equal(weights[name].to(tensor.dtype), tensor), name


def test_write_final_is_idempotent_and_cleans_a_crashed_attempt(tmp_path, finished_run):
    run = make_run(tmp_path / "run", finished=False)
    (tmp_path / "run" / f".{FINAL_DIR}.tmp-crashed").mkdir()  # an export killed before its rename
    ((tmp_path / "run" / f".{FINAL_DIR}.tmp-crashed") / WEIGHTS).write_bytes(b"half")
    first = write_final(run, _ckpt(run, TOTAL), log=_quiet)
    assert not list(run.glob(f".{FINAL_DIR}.tmp-*"))
    before = tree_digest(run)
    lines = []
    again = write_final(run, _ckpt(run, TOTAL), log=lines.append)
    assert again == first and tree_digest(run) == before and "already holds the verified export" in lines[0]


@pytest.mark.parametrize("damage", ["corrupt", "other_source"])
def test_a_final_that_does_not_verify_or_came_from_another_checkpoint_is_set_aside(tmp_path, damage):
    run = make_run(tmp_path / "run", finished=False)
    write_final(run, _ckpt(run, 20 if damage == "other_source" else TOTAL), log=_quiet)
    if damage == "corrupt":
        weights = run / FINAL_DIR / WEIGHTS
        weights.write_bytes(b"x" + weights.read_bytes()[1:])
    old = tree_digest(run / FINAL_DIR)
    lines = []
    write_final(run, _ckpt(run, TOTAL), log=lines.append)
    assert final_status(run, _ckpt(run, TOTAL)) == (True, "ok")
    aside = [p for p in run.iterdir() if p.name.startswith(f"{FINAL_DIR}.set-aside-")]
    assert len(aside) == 1 and tree_digest(aside[0]) == old  # kept, byte for byte
    assert any("set final/ aside" in line for line in lines)


def _end_run(out: Path, *, stage="pretraining", kind="pretrain", export_final=None, cleanup="off"):
    cfg = SimpleNamespace(stage=stage, data=SimpleNamespace(kind=kind),
                          training=SimpleNamespace(export_final=export_final, cleanup_after_success=cleanup))
    lines = []
    run = SimpleNamespace(cfg=cfg, rank=0, output_dir=out, barrier=lambda: None,
                          progress=SimpleNamespace(message=lines.append))
    return StageEndCallback(run), lines


def _state(step, stop=False):
    return SimpleNamespace(step=step, total_steps=TOTAL, stop_requested=stop)


def test_a_stage_stopped_early_or_by_a_signal_writes_no_final(tmp_path):
    run = make_run(tmp_path / "run", steps=(10, 20), finished=False)
    before = tree_digest(run)
    callback, _ = _end_run(run)
    callback.on_end(_state(20))  # stopped before its last step
    assert tree_digest(run) == before
    cfg, state = tiny_state()
    write_step(run, TOTAL, cfg, state, reason="stop signal")
    before = tree_digest(run)
    callback.on_end(_state(TOTAL, stop=True))  # a signal at the last step: the relaunch writes it
    assert tree_digest(run) == before and not (run / FINAL_DIR).exists() and not (run / COMPLETE_FILE).exists()


def test_the_stage_end_writes_final_then_the_record_and_sft_too_unless_turned_off(tmp_path):
    run = make_run(tmp_path / "run", finished=False)
    callback, lines = _end_run(run)
    callback.on_end(_state(TOTAL))
    assert final_status(run, _ckpt(run, TOTAL)) == (True, "ok")
    done = read_completion(run)
    assert done["final"] == FINAL_DIR and done["final_manifest_sha256"]
    assert json.loads((run / FINAL_DIR / EXPORT_MANIFEST).read_text())["stage"] == "pretraining"
    before = tree_digest(run)
    callback.on_end(_state(TOTAL))  # the finished stage relaunched: nothing to write, nothing rewritten
    assert tree_digest(run) == before
    sft = make_run(tmp_path / "sft", finished=False)
    callback, _ = _end_run(sft, stage="supervised-finetuning", kind="sft")
    callback.on_end(_state(TOTAL))  # SFT writes final/ at completion like the other stages (issue 33)
    assert final_status(sft, _ckpt(sft, TOTAL)) == (True, "ok") and read_completion(sft)["final"] == FINAL_DIR
    off = make_run(tmp_path / "off", finished=False)
    callback, _ = _end_run(off, stage="supervised-finetuning", kind="sft", export_final=False)
    callback.on_end(_state(TOTAL))
    assert not (off / FINAL_DIR).exists() and read_completion(off)["final"] is None


def test_export_final_defaults_by_stage_and_cleanup_needs_it():
    pre = tcfg.load_config(REPO / "ds_configs/tiny/pretrain.yaml")
    sft = tcfg.load_config(REPO / "ds_configs/tiny/sft.yaml")
    assert export_final_enabled(pre) and export_final_enabled(sft)
    assert not export_final_enabled(tcfg.load_config(REPO / "ds_configs/tiny/sft.yaml", ["training.export_final=false"]))
    assert tcfg.load_config(REPO / "ds_configs/tiny/sft.yaml", ["training.cleanup_after_success=keep_final"])
    with pytest.raises(tcfg.ConfigError, match="training.cleanup_after_success.*training.export_final true"):
        tcfg.load_config(REPO / "ds_configs/tiny/sft.yaml", ["training.cleanup_after_success=keep_final",
                                                             "training.export_final=false"])
    with pytest.raises(tcfg.ConfigError, match="cleanup_after_success"):
        tcfg.load_config(REPO / "ds_configs/tiny/pretrain.yaml", ["training.cleanup_after_success=everything"])


def test_cleanup_after_success_runs_at_the_end_and_waits_for_the_hub_when_the_run_syncs(tmp_path):
    run = make_run(tmp_path / "run", packs={10: 1, 30: 2}, finished=False)
    callback, lines = _end_run(run, cleanup="keep_packs")
    callback.on_end(_state(TOTAL))
    assert [c.step for c in list_checkpoints(run)] == [10, 30] and final_status(run)[0]
    synced = make_run(tmp_path / "synced", finished=False, keep_unsynced=True)
    callback, lines = _end_run(synced, cleanup="keep_final")
    callback.on_end(_state(TOTAL))  # nothing on the Hub yet: the watcher cleans up later
    assert [c.step for c in list_checkpoints(synced)] == [10, 20, 30] and read_completion(synced)
    assert any("cleanup after success deferred" in line and "not verified on the Hub" in line for line in lines)
