"""Launches that must be refused before they write anything, through the real entry point.

One short run (two steps, a checkpoint each) is shared; every other launch provokes one refusal
and asserts exit 2, the message, and that no file anywhere under the test folder changed (the
embedded corpus, the shard cache and the output directories included)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ds_trhash.data.embedded import build_embedded
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


def test_a_deleted_or_altered_shard_is_found_at_launch_before_the_model(root, tmp_path):
    paths = build_embedded(root / "embedded")
    shards = tmp_path / "shards"
    shutil.copytree(paths.shards_dir, shards)
    (shards / "topics_a" / "shard-00000.bin").unlink()
    second = shards / "topics_b" / "shard-00000.bin"
    raw = bytearray(second.read_bytes())
    raw[10] ^= 0xFF
    second.write_bytes(bytes(raw))
    err = _refused(root, _args(root / "shard-run", "--set", f"data.plan={paths.pretrain_plan}",
                               "--set", f"data.shards_dir={shards}"),
                   "do not match the plan", "topics_a/shard-00000.bin is missing",
                   "topics_b/shard-00000.bin does not match the sha256")
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
                   "already holds 'pretraining' checkpoints")
    assert f"the run's final complete checkpoint is {root / 'base' / 'checkpoints' / 'step_00000002'}" in err
