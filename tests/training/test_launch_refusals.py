"""Launches that must be refused before they write anything, through the real entry point.

One short run (two steps, a checkpoint each) is shared; every other launch provokes one refusal
and asserts exit 2, the message, and that no file anywhere under the test folder changed (the
embedded corpus, the shard cache and the output directories included)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ds_trhash import checkpoints as ckpt
from ds_trhash.cli import main as cli_main
from ds_trhash.data.embedded import build_embedded
from ds_trhash.io import sha256_file
from ds_trhash.training.entrypoint import main as entrypoint_main
from tests.fail_closed import flip_byte, tree_digest
from tests.training import launch_utils as L

pytestmark = pytest.mark.e2e


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


def test_resume_auto_over_only_damaged_checkpoints_refuses_then_sets_them_aside_when_told(root, capsys):
    run = root / "damaged"
    shutil.copytree(root / "base", run)
    _damage(run)
    err = _refused_here(capsys, root, _args(run, "--resume", "auto"), "--resume auto found checkpoints",
                        "step_00000001 is corrupt", "step_00000002 is corrupt", "--allow-fresh-over-damaged")
    assert "starting fresh" not in err
    # every file of the earlier run that the new one writes, markers included (issue: stage_complete.json)
    earlier = {name: tree_digest(run / name) if (run / name).is_dir() else sha256_file(run / name)
               for name in ("config.json", "metrics.csv", "expert_load.csv", "final", "stage_complete.json")}
    proc = L.single(_args(run, "--resume", "auto", "--allow-fresh-over-damaged", steps=1))
    assert proc.returncode == 0, L.explain(proc)
    aside = sorted(p.name for p in (run / "checkpoints").iterdir() if ".damaged-" in p.name)
    assert [name.split(".")[0] for name in aside] == ["step_00000001", "step_00000002"]
    assert any(p.name.startswith("metrics.csv.damaged-") for p in run.iterdir())
    assert L.checkpoint_steps(run) == [1]
    for name, digest in earlier.items():
        kept = [p for p in run.iterdir() if p.name.startswith(f"{name}.damaged-")]
        assert len(kept) == 1, (name, sorted(p.name for p in run.iterdir()))
        assert (tree_digest(kept[0]) if kept[0].is_dir() else sha256_file(kept[0])) == digest, name
        assert (run / name).exists()  # the new run's own


def test_a_refused_launch_creates_no_corpus_cache_or_output(tmp_path):
    parent = tmp_path / "elsewhere"
    (parent / "run").mkdir(parents=True)
    (parent / "run" / "metrics.csv").write_text("step,train_loss\n1,9.0\n")
    _refused(tmp_path, _args(parent / "run"), "already holds a run (a metrics.csv)")
    assert sorted(p.name for p in parent.iterdir()) == ["run"]  # no embedded/ corpus, no shard_cache


def test_data_tokenizer_is_checked_against_the_plan_and_shards(root, tmp_path, capsys, rank_zero_of_one):
    paths = build_embedded(root / "embedded")  # the corpus the base run used: found, not rebuilt
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"another": "tokenizer"}')
    data = ["--set", f"data.plan={paths.pretrain_plan}", "--set", f"data.shards_dir={paths.shards_dir}"]
    _refused_here(capsys, root, _args(root / "tok-run", *data, "--set", f"data.tokenizer={other}"),
                  "data.tokenizer", "but the plan", "the topics_a shard manifest records")


def test_a_deleted_or_truncated_shard_is_found_at_launch_before_the_model(root, tmp_path):
    """The launch checks sizes from one listing of the store; a shard's bytes are hashed when it
    enters the node's cache (tests/data/stream/cache/test_shard_cache.py: a changed shard stops the run naming both
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


def test_resume_of_another_runs_checkpoint_into_a_new_directory_needs_fork(root, capsys):
    step2 = root / "base" / "checkpoints" / "step_00000002"
    _refused_here(capsys, root, _args(root / "forked", "--resume", str(step2)),
                  f"is a checkpoint of the run in {root / 'base'}", "--fork")


def test_init_checkpoint_missing_says_does_not_exist_and_a_run_dir_means_its_final_checkpoint(root, capsys):
    _refused_here(capsys, root, _args(root / "ref", "--init-checkpoint", str(root / "nope"), config="refine"),
                  f"--init-checkpoint {root / 'nope'} does not exist")
    # A run directory names its final complete checkpoint, said at start (this launch is then
    # refused for writing into a pretraining run's directory, before anything is written), on the
    # console of the real command.
    err = _refused(root, _args(root / "base", "--init-checkpoint", str(root / "base"), config="refine"),
                   f"--output-dir {root / 'base'} holds --init-checkpoint")
    assert f"the run's final complete checkpoint is {root / 'base' / 'checkpoints' / 'step_00000002'}" in err


# --- in-process refusals (entrypoint.main returns before the model and the data side exist; those the
# plan makes, after its one-rank process group started)


def _refused_here(capsys, root: Path, argv: list[str], *needles: str) -> str:
    """``capsys``, or ``capfd`` where a process the launch starts could write too."""
    before = tree_digest(root)
    rc = entrypoint_main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err[-3000:]
    for needle in needles:
        assert needle in err, err[-3000:]
    assert tree_digest(root) == before, "a refused launch changed files"
    return err


@pytest.fixture()
def rank_zero_of_one(monkeypatch):
    """``entrypoint.main`` in this process starts a one-rank gloo group when a refusal comes from the
    plan: on a free port (29500, its default, may be another launch's), the variables it reads
    put back after the test."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(L.free_port())}.items():
        monkeypatch.setenv(key, value)


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


def test_a_plan_that_is_a_directory_or_whose_vocabulary_exceeds_the_models_is_refused(root, tmp_path, capsys,
                                                                                  rank_zero_of_one):
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


def _model_states(step: Path) -> Path:
    return next((step / "state").rglob("mp_rank_00_model_states.pt"))


def _flip_byte(step: Path) -> str:
    """One byte of the model file changed (same size): the SHA-256 differs from the manifest."""
    states = _model_states(step)
    flip_byte(states)
    return f"{step.name} is corrupt ({states.relative_to(step)} SHA-256 differs from {ckpt.MANIFEST})"


def _damaged_tensor(step: Path) -> str:
    _flip_byte(step)
    return (f"cannot initialise from {step}: it is corrupt ({_model_states(step).relative_to(step)} SHA-256 "
            f"differs from {ckpt.MANIFEST})")


def _resealed_wrong_content(step: Path) -> str:
    """A valid torch file of other tensors, resealed into the manifest: it verifies."""
    states = _model_states(step)
    torch.save({"module": {"embed.weight": torch.zeros(3, 3)}}, states)
    manifest = json.loads((step / ckpt.MANIFEST).read_text())
    rel = str(states.relative_to(step))
    manifest["files"][rel] = {**manifest["files"][rel], "sha256": sha256_file(states), "size": states.stat().st_size}
    (step / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.verify(step) == (True, "ok")
    return f"the weights of --init-checkpoint {step} do not fit this model (4 layers, hidden 128)"


@pytest.mark.parametrize("spoil", [_damaged_tensor, _resealed_wrong_content])
def test_an_init_checkpoint_that_is_damaged_or_another_models_is_refused_before_the_data_starts(
        root, capfd, rank_zero_of_one, spoil):
    """Refused as one error line, exit 2, with the weights checked before the stream (and its
    prefetch process) starts: no traceback from a process torn down on the way out (read at the
    file descriptors, where that process writes), no shard cache, no output directory, no lock."""
    source = root / f"init-{spoil.__name__.strip('_')}"
    shutil.copytree(root / "base" / "checkpoints" / "step_00000002", source)
    line = spoil(source)
    cache = root / "refused-cache"
    argv = _args(root / "refined", "--init-checkpoint", str(source), "--set", f"data.cache_dir={cache}", config="refine")
    err = _refused_here(capfd, root, argv, f"error: {line}")
    assert not cache.exists() and not (root / "refined").exists()
    # `ds-trhash preflight` makes the launch's own check: the same words, on its stage line
    refusal = next(x for x in err.splitlines() if x.startswith("error: "))
    before = tree_digest(root)
    assert cli_main(["preflight", *argv]) == 2
    failed = [x for x in capfd.readouterr().out.splitlines() if x.startswith("FAIL")]
    assert failed == [f"FAIL  stage: {refusal.removeprefix('error: ')}"], failed
    assert tree_digest(root) == before


def test_init_checkpoint_of_a_run_whose_checkpoints_are_all_damaged_is_refused_not_taken_from_final(
        root, capfd, rank_zero_of_one):
    """A completed run whose checkpoints are present but do not verify is no run after cleanup:
    refused, each checkpoint named with what is wrong, and RUN/final offered explicitly."""
    run = root / "all-damaged"
    shutil.copytree(root / "base", run)
    wrong = [_flip_byte(run / "checkpoints" / f"step_{step:08d}") for step in (1, 2)]
    assert tree_digest(run / "final") == tree_digest(root / "base" / "final")  # its export is intact
    err = _refused_here(capfd, root, _args(root / "refined", "--init-checkpoint", str(run), config="refine"),
                        f"error: --init-checkpoint {run}: the completed stage's last checkpoint", *wrong,
                        f"--init-checkpoint {run / 'final'} takes its export explicitly")
    assert "gone (cleanup)" not in err and "using its" not in err
