"""Every path a config names is checked where the config is, before anything starts, naming its
key: the launch (`launch/train.py`, whose entry point runs in-process here, and once as a real
process) and `ds-trhash preflight` refuse each the same way, and nothing on disk changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_trhash.cli import main as cli_main
from ds_trhash.run import main as launch_main
from tests.fail_closed import tree_digest
from tests.training import launch_utils as L

PRETRAIN, SFT = "ds_configs/tiny/pretrain.yaml", "ds_configs/tiny/sft.yaml"


def _cases(tmp: Path) -> list[tuple[str, list[str], str, str]]:
    """(config, --set overrides, key, what the message says) for each kind of wrong path."""
    file, folder, missing = tmp / "a-file", tmp / "a-folder", tmp / "missing"
    return [
        (PRETRAIN, [f"eval.piqa={missing}/piqa.jsonl"], "eval.piqa", f"PIQA set {missing}/piqa.jsonl does not exist"),
        (PRETRAIN, [f"eval.piqa={folder}"], "eval.piqa", f"PIQA set {folder} is a directory, not a JSONL file"),
        (PRETRAIN, [f"data.plan={missing}.json"], "data.plan", f"replay plan {missing}.json does not exist"),
        (PRETRAIN, [f"data.plan={folder}"], "data.plan", f"replay plan {folder} is a directory, not a plan file"),
        (PRETRAIN, [f"data.plan={file}", f"data.shards_dir={file}"], "data.shards_dir",
         f"corpus {file} is a file, not a directory"),
        (PRETRAIN, [f"data.tokenizer={missing}"], "data.tokenizer", f"tokenizer {missing} does not exist"),
        (PRETRAIN, [f"data.cache_dir={file}/cache"], "data.cache_dir", f"{file}/cache lies below the regular file {file}"),
        (SFT, [f"data.sft_dir={missing}", "source_stage=refinement"], "data.sft_dir", f"SFT set {missing} does not exist"),
        (SFT, [f"data.sft_dir={file}", "source_stage=refinement"], "data.sft_dir", f"SFT set {file} is a file, not a directory"),
    ]


def _argv(tmp: Path, config: str, sets: list[str]) -> list[str]:
    return ["--config", config, "--output-dir", str(tmp / "run"), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture
def tmp(tmp_path):
    (tmp_path / "a-file").write_text("{}\n")
    (tmp_path / "a-folder").mkdir()
    return tmp_path


def test_the_launch_and_preflight_refuse_each_wrong_path_naming_its_key(tmp, capsys):
    for config, sets, key, says in _cases(tmp):
        before = tree_digest(tmp)
        assert launch_main(_argv(tmp, config, sets)) == 2
        err = capsys.readouterr().err
        assert f": {key}: {says}" in err and err.startswith("error: ") and "Traceback" not in err, err
        assert cli_main(["preflight", *_argv(tmp, config, sets)]) == 2
        lines = capsys.readouterr().out.splitlines()
        assert f"FAIL  paths: {err.removeprefix('error: ').splitlines()[0]}" in lines, lines  # the same words
        assert tree_digest(tmp) == before, key


def test_paths_that_are_right_pass_and_a_hub_store_is_not_a_local_path(tmp):
    from ds_trhash.training import config as tcfg

    ok = tcfg.load_config(PRETRAIN, [f"eval.piqa={tmp / 'a-file'}", f"data.tokenizer={tmp / 'a-folder'}",
                                     f"data.plan={tmp / 'a-file'}", "data.shards_dir=hf://datasets/me/shards",
                                     f"data.cache_dir={tmp / 'new' / 'cache'}"])
    tcfg.check_paths(ok)


@pytest.mark.e2e
def test_a_missing_piqa_file_is_refused_by_the_real_launch_before_anything_starts(tmp):
    before = tree_digest(tmp)
    proc = L.single(_argv(tmp, PRETRAIN, [f"eval.piqa={tmp}/nonexistent/piqa.jsonl"]))
    assert proc.returncode == 2, L.explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, L.explain(proc)
    assert f"eval.piqa: PIQA set {tmp}/nonexistent/piqa.jsonl does not exist" in proc.stderr, L.explain(proc)
    assert tree_digest(tmp) == before
