"""Crash-safe checkpoints, verification, auto-resume, resume rules, rotation, stop signals,
weights-only init. The engine writer is a fake except in the DeepSpeed tests at the end."""
import json
import os
import signal
import socket
import threading

import pytest
import torch

from ds_trhash.training import checkpoint as ck
from ds_trhash.training.checkpoint import (
    CheckpointError,
    GracefulStop,
    ResumeError,
    TrainerState,
    check_output_dir_stage,
    check_resume_compatible,
    find_resumable,
    inspect_saved_parts,
    list_checkpoints,
    load_weights_only,
    resolve_resume,
    rotate,
    save_checkpoint,
    verify,
)
from ds_trhash.training.stages import Stage

CRITICAL = {"data.seq_len": 128, "optimizer.lr": 2e-5, "optimizer.betas": [0.9, 0.95], "training.epochs": 3}


def state(step, world_size=1, **over):
    fields = dict(stage="pretraining", step=step, epoch=0, data_cursor=step * 8, world_size=world_size,
                  training_critical=dict(CRITICAL), plan_fingerprint="f" * 64, plan_sha256="a" * 64,
                  backends_used={"experts": "pytorch"}, lora=False, family="language",
                  framework_commit="test")
    fields.update(over)
    return TrainerState(**fields)


def fake_engine(payload=b"engine-bytes"):
    def write(tmp):
        (tmp / "state").mkdir(exist_ok=True)
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(payload)
        (tmp / "latest").write_text("state")
    return write


def save(out, step, **kw):
    kw.setdefault("write_engine_state", fake_engine())
    kw.setdefault("trainer_state", state(step))
    return save_checkpoint(out, step, rank=0, world_size=kw.pop("world_size", 1), **kw)


def messages():
    lines = []
    return lines, lines.append


# --------------------------------------------------------------------------- writing


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


# --------------------------------------------------------------------------- resolve_resume


def test_resolve_resume_modes(tmp_path):
    lines, log = messages()
    assert resolve_resume(None, None, tmp_path, log) is None and resolve_resume("", "", tmp_path, log) is None
    assert resolve_resume("auto", None, tmp_path, log) is None
    assert "no complete checkpoint" in lines[-1] and "starting fresh" in lines[-1]
    save(tmp_path, 10)
    assert resolve_resume(None, "auto", tmp_path, log).step == 10
    explicit = resolve_resume(str(tmp_path / "checkpoints/step_00000010"), None, tmp_path / "other", log)
    assert explicit.step == 10
    assert ck.read_trainer_state(explicit)["step"] == 10 and str(explicit) == str(explicit.path)


def test_resolve_resume_explicit_broken_dir_is_an_error(tmp_path):
    path = save(tmp_path, 10)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(ResumeError, match=r"cannot resume from .*step_00000010: it is incomplete \(MANIFEST.json"):
        resolve_resume(str(path), None, tmp_path)
    with pytest.raises(ResumeError, match="disagree"):
        resolve_resume("auto", str(path), tmp_path)


# --------------------------------------------------------------------------- resume compatibility


def compat(saved=None, current=None, **kw):
    kw = {"world_size": 1, "lora_enabled": False, "total_steps": 100, **kw}
    check_resume_compatible((saved or state(40)).to_dict(), current or dict(CRITICAL), **kw)


def test_identical_settings_resume():
    compat(current={**CRITICAL, "optimizer.betas": (0.9, 0.95)}, found=dict.fromkeys(ck.REQUIRED_STATE_PARTS, True),
           plan_sha256="a" * 64, stage="pretraining")


def test_every_differing_setting_is_listed_with_old_and_new_values():
    current = {**CRITICAL, "optimizer.lr": 1e-4, "training.epochs": 4, "data.packing.policy": "per_document"}
    del current["data.seq_len"]
    with pytest.raises(ResumeError) as info:
        compat(current=current)
    msg = str(info.value)
    assert "4 difference(s)" in msg
    assert "optimizer.lr: checkpoint 2e-05, this run 0.0001" in msg
    assert "training.epochs: checkpoint 3, this run 4" in msg
    assert "data.packing.policy: checkpoint '<absent>', this run 'per_document'" in msg
    assert "data.seq_len: checkpoint 128, this run '<absent>'" in msg
    assert "--init-checkpoint" in msg


def test_nested_settings_are_compared_key_by_key():
    saved = state(40, training_critical={"optimizer": {"lr": 1.0, "betas": [0.9, 0.95]}})
    with pytest.raises(ResumeError, match=r"optimizer.betas: checkpoint \[0.9, 0.95\], this run \[0.9, 0.99\]"):
        compat(saved, current={"optimizer": {"lr": 1.0, "betas": (0.9, 0.99)}})


def test_world_size_change_points_to_reshard():
    with pytest.raises(ResumeError, match="world_size: checkpoint 1, this run 4 .*--reshard"):
        compat(world_size=4)
    compat(world_size=4, reshard=True)


@pytest.mark.parametrize("saved_lora,run_lora", [(True, False), (False, True)])
def test_lora_and_full_parameter_never_mix(saved_lora, run_lora):
    with pytest.raises(ResumeError, match="lora: checkpoint is (LoRA|full-parameter), this run is"):
        compat(state(40, lora=saved_lora), lora_enabled=run_lora)


@pytest.mark.parametrize("step", [100, 101])
def test_resume_at_or_past_the_end_refused(step):
    with pytest.raises(ResumeError, match=f"at step {step}, at or past the end of this run \\(100 steps\\)"):
        compat(state(step))


def test_other_stage_refused():
    with pytest.raises(ResumeError, match="stage: checkpoint 'pretraining', this run 'refinement'"):
        compat(stage="refinement")


def test_changed_plan_file_refused():
    with pytest.raises(ResumeError, match="plan_sha256: checkpoint 'aaa.*this run 'bbb"):
        compat(plan_sha256="b" * 64)


def test_missing_optimizer_scheduler_or_rng_refused():
    with pytest.raises(ResumeError) as info:
        compat(found={"model": True, "optimizer": False, "scheduler": False, "rng": False})
    msg = str(info.value)
    assert "3 difference(s)" in msg
    for part in ("optimizer", "scheduler", "rng"):
        assert f"no {part} state was found" in msg


def test_incomplete_saved_state_refused():
    doc = state(40).to_dict()
    del doc["world_size"]
    with pytest.raises(CheckpointError, match="lacks world_size"):
        check_resume_compatible(doc, CRITICAL, world_size=1, lora_enabled=False, total_steps=100)


def test_output_dir_of_another_stage_refused(tmp_path):
    save(tmp_path, 10)
    check_output_dir_stage(tmp_path, "pretraining")
    with pytest.raises(ResumeError, match="already holds 'pretraining' checkpoints.*this launch is 'refinement'"):
        check_output_dir_stage(tmp_path, "refinement")


def test_inspect_saved_parts_sees_what_is_missing(tmp_path):
    def engine(optimizer, scheduler, optim_files=()):
        def write(tmp):
            (tmp / "state").mkdir()
            torch.save({"module": {}, "optimizer": optimizer, "lr_scheduler": scheduler},
                       tmp / "state/mp_rank_00_model_states.pt")
            for name in optim_files:
                (tmp / "state" / name).write_bytes(b"x")
        return write

    full = save(tmp_path / "a", 1, write_engine_state=engine({"state": {}}, {"last_epoch": 1}))
    assert inspect_saved_parts(full) == {"model": True, "optimizer": True, "scheduler": True, "rng": True}
    bare = save(tmp_path / "b", 1, write_engine_state=engine(None, None))
    assert inspect_saved_parts(bare) == {"model": True, "optimizer": False, "scheduler": False, "rng": True}
    zero = save(tmp_path / "c", 1, write_engine_state=engine(None, {}, ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]))
    assert inspect_saved_parts(zero)["optimizer"] is True
    assert inspect_saved_parts(zero, world_size=2) == {"model": True, "optimizer": False, "scheduler": True,
                                                        "rng": False}
    with pytest.raises(ResumeError, match="no optimizer, scheduler state"):
        ck.load_engine_state(object(), bare)


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


# --------------------------------------------------------------------------- graceful stop


def test_sigterm_sets_the_flag_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    lines, log = messages()
    with GracefulStop(log=log) as stop:
        assert not stop.should_stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop and stop.received == "SIGTERM"
        assert "writing a checkpoint" in lines[0]
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_graceful_stop_outside_the_main_thread_is_refused():
    errors = []

    def enter():
        try:
            with GracefulStop():
                pass
        except CheckpointError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


# --------------------------------------------------------------------------- weights only


def test_weights_only_from_safetensors_export(tmp_path):
    from safetensors.torch import save_file

    weights = {"embed_tokens.weight": torch.randn(5, 3), "route_table": torch.arange(6).reshape(2, 3)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    sd, record = load_weights_only(tmp_path)
    assert record.stage is None and record.path == str(tmp_path)
    assert all(torch.equal(sd[k], v) for k, v in weights.items()) and set(sd) == set(weights)
    (tmp_path / "run.json").write_text(json.dumps({"stage": "refinement", "plan_fingerprint": "ab",
                                                   "family": "language"}))
    _, record = load_weights_only(tmp_path)
    assert record.stage is Stage.REFINEMENT and record.plan_fingerprint == "ab" and record.lora is False


def test_weights_only_refuses_unknown_or_damaged_sources(tmp_path):
    with pytest.raises(CheckpointError, match="neither a ds-trhash checkpoint.*nor an export"):
        load_weights_only(tmp_path)
    path = save(tmp_path, 3)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=r"cannot initialise from .*incomplete \(MANIFEST.json missing\)"):
        load_weights_only(path)


# --------------------------------------------------------------------------- real DeepSpeed


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deepspeed_env():
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _engine(zero_stage):
    import deepspeed

    torch.manual_seed(zero_stage)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    config = {"train_batch_size": 1, "zero_optimization": {"stage": zero_stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _train_step(engine):
    loss = engine(torch.ones(1, 4)).pow(2).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_real_deepspeed_checkpoint_weights_only_and_exact_resume(tmp_path, deepspeed_env, zero_stage):
    engine = _engine(zero_stage)
    _train_step(engine)
    path = save(tmp_path, 1, write_engine_state=lambda tmp: engine.save_checkpoint(str(tmp), tag=ck.ENGINE_TAG))
    assert verify(path) == (True, "ok")
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    # Weights only: ZeRO-1 goes through DeepSpeed's consolidator, stage 0 through the module file.
    sd, record = load_weights_only(path)
    assert record.stage is Stage.PRETRAINING and record.plan_fingerprint == "f" * 64
    assert set(sd) == set(saved) and all(torch.equal(sd[k], saved[k]) and sd[k].dtype == torch.float32 for k in sd)

    # Exact resume: training on moves weights, optimizer and schedule; the load brings all back.
    assert inspect_saved_parts(path) == dict.fromkeys(ck.REQUIRED_STATE_PARTS, True)
    lr_saved = engine.get_lr()
    _train_step(engine)
    continued = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    assert not torch.equal(continued["0.weight"], saved["0.weight"])
    _train_step(engine)
    ck.load_engine_state(engine, path)
    assert all(torch.equal(v, saved[k]) for k, v in engine.module.state_dict().items())
    assert engine.get_lr() == lr_saved
    _train_step(engine)  # same step from the restored Adam moments and schedule: same weights
    assert all(torch.equal(v, continued[k]) for k, v in engine.module.state_dict().items())
    if zero_stage == 0:  # no partition files: the whole optimizer state loads as saved
        ck.load_engine_state(engine, path, reshard=True)
    else:  # partitioned optimizer state needs the universal conversion, set at initialize time
        with pytest.raises(CheckpointError, match="load_universal=True"):
            ck.load_engine_state(engine, path, reshard=True)


def test_load_merged_weights_folds_lora_adapters_with_the_recorded_alpha(tmp_path):
    import json as _json

    from safetensors.torch import save_file

    from ds_trhash.model import TRHashConfig, TRHashForCausalLM
    from ds_trhash.model.lora import apply_lora, has_lora_state, merge_lora
    from ds_trhash.training.checkpoint import load_merged_weights
    from ds_trhash.training.config import LoraSection

    torch.manual_seed(0)
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny"))
    apply_lora(model, LoraSection(enabled=True, rank=4, alpha=8.0, dropout=0.0))
    for name, p in model.named_parameters():
        if name.endswith("lora_B"):
            torch.nn.init.normal_(p)  # non-zero adapters, so merging changes the base tensors
    src = tmp_path / "lora-export"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"))
    (src / "run.json").write_text(_json.dumps({"stage": "supervised-finetuning", "lora": True,
                                               "training_critical": {"lora.alpha": 8.0}}))
    merged, record = load_merged_weights(src)
    assert not has_lora_state(merged) and record.stage.value == "supervised-finetuning"
    expected = merge_lora(model)
    assert merged.keys() == expected.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in expected)

    (src / "run.json").write_text(_json.dumps({"stage": "supervised-finetuning", "lora": True}))
    with pytest.raises(CheckpointError, match="records no lora.alpha"):
        load_merged_weights(src)
