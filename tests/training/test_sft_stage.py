"""The tiny three-stage pipeline through real launches: pretraining → refinement → SFT, with
held-out evaluation, best/ selection, LoRA mode and the stage/mode refusals."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_trhash.checkpoints.run_lock import RUN_LOCK
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


def _ok(proc):
    assert proc.returncode == 0, L.explain(proc)
    return proc


@pytest.fixture(scope="module")
def stages(tmp_path_factory, shared_launches):
    root = tmp_path_factory.mktemp("stages")
    ref = root / "ref"
    pre = shared_launches.get(1, L.tiny_pretraining)  # also test_launch's loss-falls run: read only
    pre_ckpt = pre / "checkpoints" / f"step_{30:08d}"
    proc = _ok(L.single(["--config", "ds_configs/tiny/refine.yaml", "--output-dir", str(ref), "--max-steps", "10",
                         "--init-checkpoint", str(pre_ckpt)]))
    return {"root": root, "pre": pre_ckpt, "ref": ref / "checkpoints" / f"step_{10:08d}", "ref_proc": proc}


def _piqa_file(root):
    rows = [{"goal": f"To open file number {i}", "sol1": "use the open function.", "sol2": "delete the disk.",
             "label": i % 2} for i in range(6)]
    path = root / "piqa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def sft(stages):
    """Full-parameter SFT from the refinement checkpoint, with held-out eval and PIQA: (output dir, launch)."""
    out = stages["root"] / "sft"
    proc = _ok(L.single(["--config", "ds_configs/tiny/sft.yaml", "--output-dir", str(out),
                         "--init-checkpoint", str(stages["ref"]), "--source-stage", "refinement",
                         "--set", f"eval.piqa={_piqa_file(stages['root'])}"]))
    return out, proc


def test_sft_heldout_loss_falls_and_best_is_selected(sft):
    out, _ = sft
    rows = [r for r in L.metrics(out) if r["eval_loss"]]
    assert len(rows) == 3  # step 0 (the source checkpoint) and the end of each of the 2 epochs
    evals = [float(r["eval_loss"]) for r in rows]
    assert evals[-1] < evals[0] - 0.1, evals
    assert all(int(r["eval_tokens"]) == int(rows[0]["eval_tokens"]) > 0 for r in rows)
    train_rows = [r for r in L.metrics(out) if r["train_loss"]]
    assert all(int(r["label_out_of_range"]) == 0 and int(r["label_valid"]) > 0 for r in train_rows)

    selection = json.loads((out / "selection.json").read_text())
    assert selection["rule"] == "min_eval_loss"
    assert [c["epoch"] for c in selection["candidates"]] == [1, 2]
    best = min(selection["candidates"], key=lambda c: c["eval_loss"])
    assert selection["selected"]["step"] == best["step"]
    L.assert_identical(L.model_weights(out / "best"), L.model_weights(out / "checkpoints" / f"step_{best['step']:08d}"))

    # PIQA beside the loss: the source at step 0 and each epoch, recorded with the candidates
    piqa = [json.loads(line) for line in (out / "piqa.jsonl").read_text().splitlines()]
    assert [p["step"] for p in piqa] == [int(r["step"]) for r in rows]
    assert all(p["n"] == 6 and 0.0 <= p["acc"] <= 1.0 and "1838" in p["warning"] for p in piqa)
    assert all(c["piqa_acc"] is not None for c in selection["candidates"])


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "ds_trhash.cli", *map(str, args)], cwd=L.REPO, env=L.base_env(),
                          capture_output=True, text=True, timeout=300)
    return _ok(proc)


def test_sft_provenance_agrees_with_itself(sft, tmp_path):
    """Epoch numbers, PIQA results and the kernel path agree across the console, selection.json,
    piqa.jsonl, the checkpoints and the run record; `eval heldout` reproduces the run's own loss."""
    out, proc = sft
    selection = json.loads((out / "selection.json").read_text())
    piqa = [json.loads(line) for line in (out / "piqa.jsonl").read_text().splitlines()]
    spe = selection["candidates"][0]["step"]  # steps per epoch
    evaluated = [(0, 0), (spe, 1), (2 * spe, 2)]  # (step, epochs completed): the source, then each epoch end
    pairs = lambda pattern: [tuple(map(int, m)) for m in re.findall(pattern, proc.stdout)]  # noqa: E731
    assert pairs(r"held-out at step (\d+) \(epoch (\d+)\)") == evaluated
    assert pairs(r"PIQA at step (\d+) \(epoch (\d+)\)") == evaluated
    assert [(p["step"], p["epoch"]) for p in piqa] == evaluated
    assert pairs(r"checkpoint step_(\d+) \(end of epoch (\d+)") == evaluated[1:]
    assert [(c["step"], c["epoch"]) for c in selection["candidates"]] == evaluated[1:]
    chosen = selection["selected"]
    assert pairs(r"best/ = epoch (\d+) \(step (\d+)\)")[-1] == (chosen["epoch"], chosen["step"])
    states = {s: json.loads((out / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())
              for s, _ in evaluated[1:]}
    assert [(s, st["epoch"]) for s, st in states.items()] == evaluated[1:]

    # the kernel path each checkpoint records is the one its training steps ran (metrics.csv),
    # not that of the PIQA / held-out forward just before the save
    rows = [r for r in L.metrics(out) if r["train_loss"]]  # every log_every steps
    for step, st in states.items():
        row = [r for r in rows if int(r["step"]) <= step][-1]
        ran = {k: row[f"{k}_backend"] for k in ("experts", "loss", "norm")}
        assert {k: st["backends_used"][k] for k in ran} == ran and ran["loss"], (step, st["backends_used"], ran)

    # the run record, written by the real command, carries the same epochs and PIQA results
    record = tmp_path / "run_record.json"
    _cli("report", "--run", out, "--out", record)
    doc = json.loads(record.read_text())
    assert [(r["step"], r["epoch"], r["acc"], r["acc_norm"]) for r in doc["piqa"]] == [
        (p["step"], p["epoch"], p["acc"], p["acc_norm"]) for p in piqa]
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    for cand in selection["candidates"]:
        entry = by_step[cand["step"]]
        assert (entry["epoch"], entry["metrics"]["piqa_acc"]) == (cand["epoch"], cand["piqa_acc"])
        assert "epoch" not in entry["metrics"]  # one epoch per checkpoint: its own, not a log row's
    assert doc["selected_checkpoint"]["epoch"] == chosen["epoch"]
    assert doc["kernel_path"] == states[chosen["step"]]["backends_used"]

    # `eval heldout` packs like the run did (its checkpoint says per_document) and gets its loss
    result = tmp_path / "heldout.json"
    _cli("eval", "heldout", "--checkpoint", chosen["checkpoint"], "--sft-dir", states[chosen["step"]]["sft_dir"],
         "--device", "cpu", "--out", result)
    heldout = json.loads(result.read_text())
    assert heldout["policy"] == "per_document" and "training_critical" in heldout["policy_source"]
    assert heldout["eval_loss"] == pytest.approx(chosen["eval_loss"], rel=1e-5)


def test_a_capped_stage_says_so_in_its_records_and_to_the_next_stage(stages, sft, tmp_path):
    """--max-steps: the schedule over N steps, the stage completes, and its completion record, its
    run record and the next stage's launch say it was capped; the SFT run writes final/ (with the
    run's tokenizer) like the other stages, and `generate --model RUN` and `report --out
    RUN/run_record.json` work as the README writes them."""
    pre_run, ref_run = stages["pre"].parent.parent, stages["ref"].parent.parent
    done = json.loads((pre_run / "stage_complete.json").read_text())
    assert done["total_steps"] == 30 and done["planned_steps"] > 30 and "capped by --max-steps" in done["capped"]
    assert "caps this stage at 10 of the" in stages["ref_proc"].stdout + stages["ref_proc"].stderr
    warned = stages["ref_proc"].stdout + stages["ref_proc"].stderr
    assert len([line for line in warned.splitlines() if line.lstrip().startswith("kernels ")]) == 1
    assert "kernel choice:" not in warned and "kernels requested" not in warned
    assert f"--init-checkpoint {stages['pre']} comes from a stage capped by --max-steps" in warned, warned[-3000:]
    out, _ = sft
    assert json.loads((out / "stage_complete.json").read_text())["final"] == "final"
    assert (out / "final" / "tokenizer.json").is_file() and (out / "best").is_dir()
    _cli("report", "--run", ref_run, "--out", ref_run / "run_record.json")
    doc = json.loads((ref_run / "run_record.json").read_text())
    assert doc["optimizer_schedule"]["capped"] and any("capped by --max-steps" in x for x in doc["known_limitations"])
    assert doc["tokenizer_hash"]
    gen = _cli("generate", "--model", out, "--prompt", "The for statement", "--max-new-tokens", "3")
    assert f"--model {out}: the run's final complete checkpoint is" in gen.stderr and "loaded checkpoint" in gen.stderr


def _digest(run):
    """Every file of a run but the data cache a launch rebuilds and the run lock, whose record
    names the last launch that held it (every launch that writes leaves its own there)."""
    return {k: v for k, v in tree_digest(run).items() if not k.startswith("shard_cache") and k != RUN_LOCK}


def test_resume_auto_of_a_finished_stage_exits_0_and_completes_only_its_missing_end(stages, tmp_path):
    """After a reboot a supervised chain relaunches every stage with RESUME=auto: a finished one
    trains nothing, changes nothing, and exits 0 so its followers start. Its end-of-stage PIQA
    (configured now, never recorded) is the one thing it adds."""
    run = tmp_path / "pre"
    shutil.copytree(stages["pre"].parent.parent, run, ignore=shutil.ignore_patterns("shard_cache"))
    before = _digest(run)
    proc = _ok(L.single(["--config", "ds_configs/tiny/pretrain.yaml", "--output-dir", str(run), "--max-steps", "30",
                         "--set", f"eval.piqa={_piqa_file(tmp_path)}"], RESUME="auto"))
    assert "pretraining already finished at step 30 of 30; nothing is left to train" in proc.stdout, L.explain(proc)
    after = _digest(run)
    assert sorted(set(after) - set(before)) == ["piqa.jsonl"]
    assert {k: v for k, v in after.items() if k in before and after[k] != before[k]}.keys() == {"config.json"}
    assert [json.loads(line)["step"] for line in (run / "piqa.jsonl").read_text().splitlines()] == [30]


def test_resume_auto_after_a_stop_between_the_last_checkpoint_and_best_publishes_it(sft, stages, tmp_path):
    """SFT stopped after writing its last epoch checkpoint, before selecting best/: RESUME=auto
    adds that epoch's candidate from the checkpoint's record, republishes best/, exits 0."""
    from ds_trhash.checkpoints.selection import Candidate, publish

    out, _ = sft
    run = tmp_path / "sft"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("shard_cache"))
    full = json.loads((run / "selection.json").read_text())
    publish(run, [Candidate(**full["candidates"][0])], full["rule"])  # as it stood before the last epoch
    untouched = {k: v for k, v in _digest(run).items() if not k.startswith(("best", "selection.json"))}
    proc = _ok(L.single(["--config", "ds_configs/tiny/sft.yaml", "--output-dir", str(run),
                         "--init-checkpoint", str(stages["ref"]), "--source-stage", "refinement",
                         "--set", f"eval.piqa={_piqa_file(stages['root'])}"], RESUME="auto"))
    assert "already finished" in proc.stdout and "candidate added from" in proc.stdout, L.explain(proc)
    redone = json.loads((run / "selection.json").read_text())
    last = full["candidates"][1]
    assert redone["candidates"][1] == {**last, "checkpoint": str(run / "checkpoints" / Path(last["checkpoint"]).name)}
    assert redone["selected"]["step"] == full["selected"]["step"]
    L.assert_identical(L.model_weights(run / "best"),
                       L.model_weights(run / "checkpoints" / f"step_{full['selected']['step']:08d}"))
    assert {k: v for k, v in _digest(run).items() if k in untouched and k != "config.json"} == \
        {k: v for k, v in untouched.items() if k != "config.json"}  # piqa.jsonl, metrics, checkpoints


def test_refinement_from_an_exported_safetensors_directory(stages):
    from ds_trhash.release.export.writer import export_checkpoint

    export = stages["root"] / "pre-export"
    export_checkpoint(stages["pre"], export)
    out = stages["root"] / "ref-from-export"
    proc = _ok(L.single(["--config", "ds_configs/tiny/refine.yaml", "--output-dir", str(out), "--max-steps", "2",
                         "--init-checkpoint", str(export)]))
    assert "refinement" in proc.stdout
    # the first step starts from the exported weights: its loss is the pretrained model's, not ~ln(V)
    assert L.train_losses(out)[0] < 7.5


def test_pretraining_straight_to_sft_is_refused_before_the_model(stages):
    out = stages["root"] / "sft-from-pre"
    proc = L.single(["--config", "ds_configs/tiny/sft.yaml", "--output-dir", str(out),
                     "--init-checkpoint", str(stages["pre"]), "--source-stage", "refinement"])
    assert proc.returncode == 2
    assert "pretraining" in proc.stderr and "refinement" in proc.stderr
    assert not (out / "checkpoints").exists()


def _lora_args(stages, out):
    """A LoRA SFT run from the refinement checkpoint: 44 steps (epoch 1 ends at step 36), a
    checkpoint every 10, no held-out eval (best/ is the last)."""
    return ["--config", "ds_configs/tiny/sft_lora.yaml", "--output-dir", str(out),
            "--init-checkpoint", str(stages["ref"]), "--source-stage", "refinement",
            "--set", "checkpoint.every_steps=10", "--set", "eval.heldout=false",
            "--set", "eval.select=last", "--max-steps", "44"]


@pytest.fixture(scope="module")
def lora(stages):
    """The LoRA run, uninterrupted: its output directory."""
    out = stages["root"] / "lora-ref"
    _ok(L.single(_lora_args(stages, out)))
    return out


def test_lora_sft_trains_adapters_only_and_modes_never_resume_from_each_other(stages, lora):
    after = L.model_weights(lora / "checkpoints" / f"step_{10:08d}")
    before = L.model_weights(stages["ref"])
    adapters = [k for k in after if k.endswith(("lora_A", "lora_B"))]
    assert adapters and all(k not in before for k in adapters)
    assert any(not torch.equal(after[k], torch.zeros_like(after[k])) for k in adapters if k.endswith("lora_B"))
    L.assert_identical({k: after[k] for k in before}, before)  # every base tensor frozen

    # resume the LoRA run as a full-parameter run: refused, naming both modes, nothing changed
    unchanged = _digest(lora)
    proc = L.single([*_lora_args(stages, lora), "--resume", "auto", "--full-parameter"])
    assert proc.returncode == 2, L.explain(proc)
    assert "lora: checkpoint is LoRA, this run is full-parameter" in proc.stderr, L.explain(proc)
    assert _digest(lora) == unchanged

    # SFT → SFT from the LoRA checkpoint: the adapters are merged into the new run's start
    out2 = stages["root"] / "sft-after-lora"
    _ok(L.single(["--config", "ds_configs/tiny/sft.yaml", "--output-dir", str(out2), "--max-steps", "1",
                  "--init-checkpoint", str(lora / "checkpoints" / f"step_{10:08d}"),
                  "--source-stage", "supervised-finetuning"]))


def test_lora_sft_stopped_in_the_second_epoch_resumes_bit_identical(stages, lora):
    """Exact resume in a later epoch: the pack order of epoch 2 comes from (seed, epoch) alone and
    the LoRA dropout draws from the restored RNG, so the weights end bit-identical. The run as it
    stood after its step-40 checkpoint (epoch 1 ended at step 36) is the uninterrupted run's
    directory without its later checkpoint."""
    final = L.checkpoint_steps(lora)[-1]  # 44 (--max-steps)
    out = stages["root"] / "lora-stopped"
    shutil.copytree(lora, out, ignore=shutil.ignore_patterns("shard_cache"))
    shutil.rmtree(out / "checkpoints" / f"step_{final:08d}")
    resumed = _ok(L.single(_lora_args(stages, out) + ["--resume", "auto"]))
    assert "resuming at step 40" in resumed.stdout
    L.assert_identical(L.model_weights(out / "checkpoints" / f"step_{final:08d}"),
                       L.model_weights(lora / "checkpoints" / f"step_{final:08d}"))
