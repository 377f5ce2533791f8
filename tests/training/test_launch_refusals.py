"""Launches that must be refused before they write anything, through the real entry point.

One short run (two steps, a checkpoint each) is shared; every other launch provokes one refusal
and asserts exit 2, the message, and that no file anywhere under the test folder changed (the
embedded corpus, the shard cache and the output directories included)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.data.embedded import build_embedded
from ds_trhash.io import sha256_file
from ds_trhash.model.transformer import WeightsError
from ds_trhash.training import config as tcfg
from ds_trhash.training.launcher import main as launcher_main
from ds_trhash.training.trainer import build_model
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.launch


def _args(out, *extra, config="pretrain", steps=2):
    return ["--config", f"ds_configs/tiny/{config}.yaml", "--output-dir", str(out), "--max-steps", str(steps),
            "--set", "checkpoint.every_steps=1", "--set", "checkpoint.packs=null", "--set", "training.log_every=1",
            "--set", "batch.micro_batch=2", *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    proc = L.single(_args(root / "base"))
    assert proc.returncode == 0, L.explain(proc)
    return root


def _refused(root: Path, argv: list[str], *needles: str) -> str:
    before = tree_digest(root)
    proc = L.single(argv)
    both = proc.stdout + proc.stderr
    assert proc.returncode == 2, L.explain(proc)
    assert "Traceback" not in both, both[-4000:]
    for needle in needles:
        assert needle in proc.stderr, L.explain(proc)
    assert tree_digest(root) == before, "a refused launch changed files"
    return proc.stderr


def _damage(run: Path) -> None:
    for step in (1, 2):
        states = sorted((run / "checkpoints" / f"step_{step:08d}" / "state").rglob("*.pt"))
        states[0].write_bytes(states[0].read_bytes()[:-16])  # truncated: the manifest size no longer matches


def test_resume_auto_over_only_damaged_checkpoints_refuses_then_sets_them_aside_when_told(root):
    run = root / "damaged"
    shutil.copytree(root / "base", run)
    _damage(run)
    err = _refused(root, _args(run, "--resume", "auto"), "--resume auto found checkpoints",
                   "step_00000001 is corrupt", "step_00000002 is corrupt", "--allow-fresh-over-damaged")
    assert "starting fresh" not in err
    proc = L.single(_args(run, "--resume", "auto", "--allow-fresh-over-damaged", steps=1))
    assert proc.returncode == 0, L.explain(proc)
    aside = sorted(p.name for p in (run / "checkpoints").iterdir() if ".damaged-" in p.name)
    assert [name.split(".")[0] for name in aside] == ["step_00000001", "step_00000002"]
    assert any(p.name.startswith("metrics.csv.damaged-") for p in run.iterdir())
    assert L.checkpoint_steps(run) == [1]


def test_a_refused_launch_creates_no_corpus_cache_or_output(tmp_path):
    parent = tmp_path / "elsewhere"
    (parent / "run").mkdir(parents=True)
    (parent / "run" / "metrics.csv").write_text("step,train_loss\n1,9.0\n")
    _refused(tmp_path, _args(parent / "run"), "already holds a run (a metrics.csv)")
    assert sorted(p.name for p in parent.iterdir()) == ["run"]  # no embedded/ corpus, no shard_cache


def test_data_tokenizer_is_checked_against_the_plan_and_shards(root, tmp_path):
    paths = build_embedded(root / "embedded")  # the corpus the base run used: found, not rebuilt
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"another": "tokenizer"}')
    data = ["--set", f"data.plan={paths.pretrain_plan}", "--set", f"data.shards_dir={paths.shards_dir}"]
    _refused(root, _args(root / "tok-run", *data, "--set", f"data.tokenizer={other}"),
             "data.tokenizer", "but the plan", "the topics_a shard manifest records")


def test_a_deleted_or_truncated_shard_is_found_at_launch_before_the_model(root, tmp_path):
    """The launch checks sizes from one listing of the store; a shard's bytes are hashed when it
    enters the node's cache (tests/data/stream/test_cache.py: a changed shard stops the run naming both
    hashes), not at every launch."""
    paths = build_embedded(root / "embedded")
    shards = tmp_path / "shards"
    shutil.copytree(paths.shards_dir, shards)
    (shards / "topics_a" / "shard-00000.bin").unlink()
    second = shards / "topics_b" / "shard-00000.bin"
    raw = second.read_bytes()
    second.write_bytes(raw[:-2])
    err = _refused(root, _args(root / "shard-run", "--set", f"data.plan={paths.pretrain_plan}",
                               "--set", f"data.shards_dir={shards}"),
                   "do not match the plan", "topics_a/shard-00000.bin is missing",
                   f"topics_b/shard-00000.bin holds {len(raw) - 2} bytes, its manifest {len(raw)}")
    # the trainer logs the kernels it requests while it builds the model (trainer.build_model)
    assert "kernels requested" not in err, "the shards were checked only after the model was built"


def test_resume_of_another_runs_checkpoint_into_a_new_directory_needs_fork(root):
    step2 = root / "base" / "checkpoints" / "step_00000002"
    _refused(root, _args(root / "forked", "--resume", str(step2)),
             f"is a checkpoint of the run in {root / 'base'}", "--fork")


def test_init_checkpoint_missing_says_does_not_exist_and_a_run_dir_means_its_final_checkpoint(root):
    _refused(root, _args(root / "ref", "--init-checkpoint", str(root / "nope"), config="refine"),
             f"--init-checkpoint {root / 'nope'} does not exist")
    # A run directory names its final complete checkpoint, said at start (this launch is then
    # refused for writing into a pretraining run's directory, before anything is written).
    err = _refused(root, _args(root / "base", "--init-checkpoint", str(root / "base"), config="refine"),
                   f"--output-dir {root / 'base'} holds --init-checkpoint")
    assert f"the run's final complete checkpoint is {root / 'base' / 'checkpoints' / 'step_00000002'}" in err


# --- in-process refusals (launcher.main returns before the process group or the model exists)


def _refused_here(capsys, root: Path, argv: list[str], *needles: str) -> str:
    before = tree_digest(root)
    rc = launcher_main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err[-3000:]
    assert tree_digest(root) == before, "a refused launch changed files"
    return err


def test_a_launch_never_writes_into_its_init_checkpoint_or_the_run_holding_it(root, capsys):
    step2 = root / "base" / "checkpoints" / "step_00000002"
    for out, how in ((step2, "is"), (step2 / "refined", "is inside"), (root, "holds"),
                     (root / "base" / "refined", "is inside")):
        err = _refused_here(capsys, root, _args(out, "--init-checkpoint", str(step2), config="refine"),
                            f"--output-dir {out} {how} ")
        assert str(step2) in err and "writing there would change what this command reads" in err
    # a fork of another run's checkpoint may not land inside (or over) that run either
    _refused_here(capsys, root, _args(root / "base" / "fork", "--resume", str(step2), "--fork"),
                  f"--output-dir {root / 'base' / 'fork'} is inside the run holding --resume {step2}")


def test_modifiers_without_their_option_and_an_empty_or_file_output_dir_are_refused(root, tmp_path, capsys):
    out = tmp_path / "run"
    _refused_here(capsys, tmp_path, _args(out, "--fork"), "--fork modifies --resume DIR")
    _refused_here(capsys, tmp_path, _args(out, "--fork", "--resume", "auto"), "--fork modifies --resume DIR")
    _refused_here(capsys, tmp_path, _args(out, "--allow-fresh-over-damaged"),
                  "--allow-fresh-over-damaged modifies --resume auto")
    _refused_here(capsys, tmp_path, _args(""), "--output-dir: output_dir: is empty")
    (tmp_path / "file").write_text("x")
    _refused_here(capsys, tmp_path, _args(tmp_path / "file"), f"--output-dir {tmp_path / 'file'} is a regular file")
    _refused_here(capsys, tmp_path, _args(tmp_path / "file" / "run"),
                  f"lies below the regular file {tmp_path / 'file'}")


def test_resume_of_another_runs_checkpoint_copied_under_this_output_dir_needs_fork(root, capsys):
    copy = root / "copied"
    shutil.copytree(root / "base" / "checkpoints" / "step_00000001", copy / "checkpoints" / "step_00000001")
    _refused_here(capsys, root, _args(copy, "--resume", str(copy / "checkpoints" / "step_00000001")),
                  f"was saved by the run in {root / 'base'}", "--fork")


def test_resume_auto_sets_a_damaged_newest_checkpoint_aside_before_training_on(root):
    run = root / "newest-damaged"
    shutil.copytree(root / "base", run)
    state = sorted((run / "checkpoints" / "step_00000002" / "state").rglob("*.pt"))[0]
    damaged_bytes = state.read_bytes()[:-16]
    state.write_bytes(damaged_bytes)
    proc = L.single(_args(run, "--resume", "auto"))
    assert proc.returncode == 0, L.explain(proc)
    assert "resume auto: set aside the damaged step_00000002.damaged-" in proc.stderr, L.explain(proc)
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_00000002.damaged-")]
    assert len(aside) == 1
    assert (aside[0] / state.relative_to(run / "checkpoints" / "step_00000002")).read_bytes() == damaged_bytes
    assert L.checkpoint_steps(run) == [1, 2]
    assert ckpt.verify(run / "checkpoints" / "step_00000002")[0]  # the step trained again, written anew


def test_a_diverged_run_stops_naming_the_step_and_saves_no_nan(root):
    run = root / "diverged"
    proc = L.single(_args(run, "--set", "optimizer.lr=1.0e30", steps=4))
    assert proc.returncode == 1, L.explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "training diverged" in x)
    bad = int(line.split("not finite at step ")[1].split(";")[0])
    assert 1 <= bad <= 4
    assert L.checkpoint_steps(run) == list(range(1, bad))  # every step before it was saved, none after
    for step in range(1, bad):
        assert ckpt.verify(run / "checkpoints" / f"step_{step:08d}")[0]
        assert all(torch.isfinite(t).all() for t in L.model_weights(run / "checkpoints" / f"step_{step:08d}").values())


def test_a_plan_that_is_a_directory_or_whose_vocabulary_exceeds_the_models_is_refused(root, tmp_path, capsys):
    paths = build_embedded(root / "embedded")  # the base run's corpus: found, not rebuilt
    data = ["--set", f"data.shards_dir={paths.shards_dir}"]
    _refused_here(capsys, root, _args(tmp_path / "run", *data, "--set", f"data.plan={tmp_path}"),
                  f"replay plan {tmp_path} is a directory, not a plan file")
    doc = json.loads(Path(paths.pretrain_plan).read_text())
    doc["vocab_size"] = 70000
    wide = tmp_path / "wide_plan.json"
    wide.write_text(json.dumps(doc))
    _refused_here(capsys, root, _args(tmp_path / "run", *data, "--set", f"data.plan={wide}"),
                  "data.plan", "records vocab_size 70000, more than the model's")
    assert not (tmp_path / "run").exists()


def test_an_init_checkpoint_with_valid_torch_data_but_the_wrong_tensors_is_a_user_error(root, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(root / "base" / "checkpoints" / "step_00000002", wrong)
    states = wrong / "state" / ckpt.ENGINE_TAG / "mp_rank_00_model_states.pt"
    if not states.is_file():
        states = next((wrong / "state").rglob("mp_rank_00_model_states.pt"))
    torch.save({"module": {"embed.weight": torch.zeros(3, 3)}}, states)
    manifest = json.loads((wrong / ckpt.MANIFEST).read_text())
    rel = str(states.relative_to(wrong))
    manifest["files"][rel] = {**manifest["files"][rel], "sha256": sha256_file(states), "size": states.stat().st_size}
    (wrong / ckpt.MANIFEST).write_text(json.dumps(manifest))
    # the trainer's own model builder on the real file (in-process: a launch would cost half a
    # minute to reach it; the launcher prints any such UserError as one line, exit 2)
    cfg = tcfg.load_config(str(L.REPO / "ds_configs" / "tiny" / "refine.yaml"), [f"output_dir={tmp_path / 'out'}"])
    before = tree_digest(wrong)
    with pytest.raises(WeightsError, match=f"the weights of --init-checkpoint {wrong} do not fit this model"):
        # the plan's fields build_model reads before the weights are loaded
        build_model(SimpleNamespace(cfg=cfg, model_config=tcfg.model_config(cfg), init_weights=str(wrong)), 0)
    assert tree_digest(wrong) == before and not (tmp_path / "out").exists()
