"""Run record: every docs/contracts.md §10 field, read from the run's files; missing facts listed as unknown."""
import json

import pytest
import torch

from ds_trhash.cli import main as cli
from ds_trhash.io import sha256_file
from ds_trhash.release.record.writer import RECORD_FIELDS, RecordError, build_run_record, write_run_record
from ds_trhash.checkpoints.save import save_checkpoint
from ds_trhash.training.records.metrics_csv import MetricsWriter
from ds_trhash.checkpoints.rng import save_rng_state

CRITICAL = {"optimizer.lr": 2e-5, "optimizer.betas": [0.9, 0.95], "optimizer.weight_decay": 0.1,
            "schedule.kind": "cosine", "schedule.warmup_fraction": 0.03, "schedule.floor": 0.1,
            "precision": "bf16", "batch.micro_batch": 4, "batch.grad_accum": 2, "data.seq_len": 128}


def _save(out, step, **extra):
    def engine(tmp):
        (tmp / "state").mkdir()
        (tmp / "state" / "mp_rank_00_model_states.pt").write_bytes(b"w%d" % step)
        save_rng_state(tmp, 1, {})  # the second rank's file of a world-size-2 run

    doc = dict(stage="supervised-finetuning", step=step, epoch=step // 10, data_cursor=0, world_size=2,
               training_critical=CRITICAL, plan_fingerprint=None, plan_sha256=None,
               backends_used={"experts": "triton", "loss": "chunked", "norm": "pytorch"}, lora=False,
               family="language", framework_commit="abc123", total_steps=30, **extra)
    return save_checkpoint(out, step, write_engine_state=engine, trainer_state=doc, rank=0, world_size=2,
                           rng_state={})


def _full_run(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "bpe"}')
    source = _save(tmp_path / "refine", 5)
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "manifest.json").write_text(json.dumps({"sources": [{"name": "chat", "revision": "rev-7"}]}))
    run = tmp_path / "run"
    critical_extra = {"init_checkpoint": str(source), "tokenizer_dir": str(tok)}
    CRITICAL["data.sft_dir"] = str(sft)
    with MetricsWriter(run / "metrics.csv", rank=0) as writer:
        for step, train, ev in ((0, None, 1.7), (5, 1.2, None), (10, 1.0, 0.99), (20, 0.9, 0.96), (30, 0.85, 0.97)):
            writer.write(step=step, train_loss=train, eval_loss=ev)
    for step in (10, 20, 30):
        _save(run, step, **critical_extra)
    piqa = [{"step": s, "epoch": s // 10, "acc": a, "acc_norm": a + 0.01, "n": 6, "warning": None}
            for s, a in ((0, 0.5), (10, 0.6), (20, 0.7), (20, 0.65))]  # step 20 evaluated again after a resume
    (run / "piqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in piqa) + '{"step": 30, "ac')
    export = tmp_path / "export"
    export.mkdir()
    (export / "export_manifest.json").write_text(json.dumps({"weights": {"sha256": "e" * 64}, "tokenizer": None}))
    CRITICAL.pop("data.sft_dir")
    return run, source, tok, export


def test_full_record_has_every_field(tmp_path):
    run, source, tok, export = _full_run(tmp_path)
    out = tmp_path / "rec" / "run_record.json"
    doc = write_run_record(out, run_dir=run, export_dir=export, selection_rule="min_eval_loss",
                           known_limitations=["PIQA not run"])
    assert json.loads(out.read_text()) == doc
    assert doc["unknown"] == []
    assert doc["framework_commit"] == "abc123"
    assert doc["source_checkpoint"] == str(source)
    assert doc["source_checkpoint_hash"] == sha256_file(source / "MANIFEST.json")
    assert doc["dataset_revision"]["revisions"] == ["rev-7"]
    assert doc["tokenizer_hash"] == sha256_file(tok / "tokenizer.json")
    assert doc["model_mode"] == "full" and doc["world_size"] == 2 and doc["precision"] == "bf16"
    assert doc["optimizer_schedule"]["optimizer.lr"] == 2e-5 and doc["optimizer_schedule"]["total_steps"] == 30
    assert doc["effective_batch"] == {"sequences": 16, "micro_batch": 4, "grad_accum": 2, "world_size": 2,
                                      "tokens": 2048}
    assert doc["kernel_path"] == {"experts": "triton", "loss": "chunked", "norm": "pytorch"}
    assert [c["name"] for c in doc["checkpoints"]] == ["step_00000010", "step_00000020", "step_00000030"]
    assert doc["checkpoints"][1]["metrics"]["eval_loss"] == pytest.approx(0.96)
    assert doc["checkpoints"][2]["metrics"]["train_loss"] == pytest.approx(0.85)
    # PIQA beside the loss: the source (step 0) and each checkpoint that was scored; a line cut short is skipped
    assert [(r["step"], r["epoch"], r["checkpoint"], r["acc"]) for r in doc["piqa"]] == [
        (0, 0, "source", 0.5), (10, 1, "step_00000010", 0.6), (20, 2, "step_00000020", 0.65)]
    assert doc["checkpoints"][1]["metrics"]["piqa_acc_norm"] == pytest.approx(0.66)
    assert "piqa_acc" not in doc["checkpoints"][2]["metrics"]
    assert (doc["selection_rule"], doc["selected_checkpoint"]) == ("min_eval_loss", "step_00000020")
    assert doc["export_safetensors_sha256"] == "e" * 64
    assert doc["hardware"]  # the run recorded none: detected, and said so
    assert "PIQA not run" in doc["known_limitations"]
    assert any("hardware was detected" in item for item in doc["known_limitations"])
    assert set(RECORD_FIELDS) <= set(doc)
    md = (out.parent / "run_record.md").read_text()
    assert "step_00000020 (selected)" in md and "PIQA not run" in md
    assert "| 10 | 1 | step_00000010 | 0.6 | 0.61 | 6 |" in md


def test_missing_inputs_are_listed_as_unknown_never_invented(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    doc = write_run_record(tmp_path / "run_record.json", run_dir=run)
    for name in ("stage", "source_checkpoint", "source_checkpoint_hash", "dataset_revision", "tokenizer_hash",
                 "model_mode", "optimizer_schedule", "world_size", "precision", "effective_batch", "kernel_path",
                 "checkpoints", "piqa", "selection_rule", "selected_checkpoint", "export_safetensors_sha256"):
        assert doc[name] is None and name in doc["unknown"], name
    md = (tmp_path / "run_record.md").read_text()
    assert "**dataset revision**: **unknown**" in md and "- export_safetensors_sha256" in md
    doc = build_run_record(selection_rule="lowest held-out loss, ties to the later step",
                           selected_checkpoint="step_00000020", world_size=8)
    assert doc["selection_rule"].startswith("lowest") and doc["world_size"] == 8
    assert doc["provenance"]["world_size"] == "given"
    with pytest.raises(RecordError, match="unknown run record fields"):
        build_run_record(world_sise=8)


def test_cli_report(tmp_path, capsys):
    run, _, _, export = _full_run(tmp_path)
    out = tmp_path / "record.json"
    assert cli(["report", "--run", str(run), "--out", str(out), "--export", str(export),
                "--selection-rule", "last", "--limitation", "no PIQA"]) == 0
    doc = json.loads(out.read_text())
    assert doc["selected_checkpoint"] == "step_00000030" and "no PIQA" in doc["known_limitations"]
    assert (tmp_path / "run_record.md").is_file()
    assert cli(["report", "--run", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "not a run output directory" in capsys.readouterr().err


def test_cli_report_on_a_directory_that_is_not_a_run_exits_2_and_writes_nothing(tmp_path, capsys):
    from tests.fail_closed import tree_digest

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a run")
    before = tree_digest(tmp_path)
    assert cli(["report", "--run", str(tmp_path / "notes"), "--out", str(tmp_path / "record.json")]) == 2
    err = capsys.readouterr().err
    assert "is not a run output directory (it holds no config.json, metrics.csv or checkpoints/)" in err
    assert "Traceback" not in err and tree_digest(tmp_path) == before


@pytest.mark.parametrize("damage,message", [
    (lambda run: (run / "metrics.csv").write_bytes((run / "metrics.csv").read_bytes().replace(b"0.900000,", b"0.9x,", 1)),
     "metrics.csv: line 5, column train_loss: '0.9x' is not a number"),
    (lambda run: (run / "metrics.csv").write_bytes((run / "metrics.csv").read_bytes() + b"40,\xff\n"),
     "metrics.csv: line 7 is not UTF-8 text (byte 0xff at column 4)"),
    (lambda run: [(p / "trainer_state.json").write_bytes(b"\x00not json") for p in (run / "checkpoints").iterdir()],
     "the trainer_state.json of every checkpoint is missing or unreadable"),
], ids=["not-a-number", "not-utf8", "every-state-unreadable"])
def test_report_of_damaged_run_files_is_refused_naming_file_and_line(tmp_path, capsys, damage, message):
    from tests.fail_closed import tree_digest

    run, _, _, _ = _full_run(tmp_path)
    damage(run)
    before = tree_digest(tmp_path)
    assert cli(["report", "--run", str(run), "--out", str(tmp_path / "record.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert tree_digest(tmp_path) == before


def test_report_into_the_runs_top_folder_as_documented(tmp_path, capsys):
    """`ds-trhash report --run runs/sft --out runs/sft/run_record.json` (README): a record file in the
    run's top folder is accepted, again over its own earlier record; a name the run wrote, or a
    path deeper inside the run, is still refused and changes nothing."""
    from tests.fail_closed import tree_digest

    run, _, _, _ = _full_run(tmp_path)
    (run / "config.json").write_text('{"stage": "supervised-finetuning"}')
    for _ in range(2):
        assert cli(["report", "--run", str(run), "--out", str(run / "run_record.json")]) == 0, capsys.readouterr().err
    assert json.loads((run / "run_record.json").read_text())["format"] == "ds-trhash-run-record-v1"
    assert (run / "run_record.md").is_file()
    before = tree_digest(tmp_path)
    for out in (run / "config.json", run / "checkpoints" / "record.json"):
        assert cli(["report", "--run", str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "write the report outside the run directory, or the record as RUN/run_record.json" in err, err
    assert tree_digest(tmp_path) == before


def test_the_record_carries_a_custom_models_shape(tmp_path):
    """Issue 34: a shape given in the model: section (here over the tiny preset, every size field
    changed) reaches the run record's `model` field the way a launch records it: the launch's own
    plan and trainer-state builder write the checkpoint the record reads (in-process, no launch);
    config.json, written from the same loaded config, carries it too."""
    from ds_trhash.training import config as tcfg
    from ds_trhash.training.callbacks.base import TrainState
    from ds_trhash.training.preparation.plan import plan_launch
    from ds_trhash.training.entrypoint import build_arg_parser, launch_config, launch_request
    from ds_trhash.training.trainer import build_model, start_writing, state_recorder

    shape = {"hidden_size": 96, "num_layers": 3, "num_heads": 3, "num_kv_heads": 1, "shared_width": 192,
             "num_experts": 6, "expert_width": 24, "route_seed": 7, "hash_channels": 3}
    out = tmp_path / "run"
    sets = [part for key, value in shape.items() for part in ("--set", f"model.{key}={value}")]
    args = build_arg_parser().parse_args(
        ["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(out), "--max-steps", "2", *sets])
    plan = plan_launch(launch_config(request := launch_request(args)), request, rank=0, world=1)
    model = build_model(plan, rank=0)

    def engine(tmp):
        (tmp / "state").mkdir()
        torch.save({"module": model.state_dict()}, tmp / "state" / "mp_rank_00_model_states.pt")

    start_writing(plan, rank=0)  # the data's stream: a checkpoint records its cursor
    try:
        doc = state_recorder(plan, model)(TrainState(step=2, total_steps=2), "final", {})
    finally:
        plan.data.loader.close()  # what the trainer's finally closes
    save_checkpoint(out, 2, write_engine_state=engine, trainer_state=doc, rank=0, world_size=1)
    record = write_run_record(tmp_path / "run_record.json", run_dir=out)
    assert record["model"] == plan.model_config.to_dict() == model.config.to_dict()
    assert {key: record["model"][key] for key in shape} == shape and record["model"]["head_dim"] == 32
    assert record["provenance"]["model"] == "trainer_state.json of the newest complete checkpoint"
    md = (tmp_path / "run_record.md").read_text()
    assert '"hidden_size": 96' in md and '"num_experts": 6' in md, md
    # config.json is the loaded config dumped (trainer.announce): its model: section builds the same shape
    dumped = tcfg.dump_config(plan.loaded)
    assert {key: dumped["model"][key] for key in shape} == shape
    assert tcfg.model_config(tcfg.load_config(_written(tmp_path / "config.json", dumped))) == plan.model_config


def _written(path, doc):
    path.write_text(json.dumps(doc))
    return path
