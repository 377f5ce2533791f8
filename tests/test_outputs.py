"""Output paths that would write into what a command reads, or that cannot be directories, are
refused before anything is written, naming both paths: the helpers, then `export --out`,
`sft build --out` and `report --out` through the real commands."""

import argparse
from pathlib import Path

import pytest

from ds_trhash.cli import main
from ds_trhash.outputs import OutputPathError, check_dir_target, refuse_overlap, relation, run_holding
from tests.fail_closed import tree_digest


def test_relations_follow_symlinks(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert relation(tmp_path / "a", tmp_path / "a") == "is"
    assert relation(tmp_path / "link" / "b" / "new", tmp_path / "a" / "b") == "is inside"
    assert relation(tmp_path, tmp_path / "link" / "b") == "holds"
    assert relation(tmp_path / "a2", tmp_path / "a") is None
    with pytest.raises(OutputPathError, match="holds --x"):
        refuse_overlap("--out", tmp_path, "--x", tmp_path / "a")
    refuse_overlap("--out", tmp_path, "--x", tmp_path / "a", may_hold=True)


def test_run_holding_names_the_run_of_a_step_or_best(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "run" / "best").mkdir()
    assert run_holding(tmp_path / "run" / "checkpoints" / "step_00000001") == tmp_path / "run"
    assert run_holding(tmp_path / "run" / "best") == tmp_path / "run"
    assert run_holding(tmp_path / "run") is None


def test_a_file_target_or_one_below_a_file_says_so(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="is a regular file, not a directory"):
        check_dir_target("--out", tmp_path / "f")
    with pytest.raises(OutputPathError, match=f"lies below the regular file {tmp_path / 'f'}"):
        check_dir_target("--out", tmp_path / "f" / "x" / "y")
    with pytest.raises(OutputPathError, match="--out is empty"):
        check_dir_target("--out", "")
    check_dir_target("--out", tmp_path / "new" / "deeper")


def _refused(capsys, root: Path, argv: list[str], *needles: str) -> None:
    before = tree_digest(root)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert tree_digest(root) == before


def test_export_sft_build_and_report_never_write_into_their_inputs(tmp_path, capsys):
    from ds_trhash.model import TRHashConfig
    from tests.release.checkpoint_utils import write_checkpoint

    run = tmp_path / "run"
    cfg = TRHashConfig.from_preset("tiny", num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                                   shared_width=16, vocab_size=64)
    ckpt = Path(write_checkpoint(run, cfg, {}))
    _refused(capsys, tmp_path, ["export", "--checkpoint", str(ckpt), "--out", str(ckpt / "export")],
             f"--out {ckpt / 'export'} is inside --checkpoint {ckpt}")
    (tmp_path / "file").write_text("x")
    _refused(capsys, tmp_path, ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "file" / "e")],
             f"lies below the regular file {tmp_path / 'file'}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    (data / "eval.jsonl").write_text("")
    _refused(capsys, tmp_path, ["sft", "build", "--input", str(data / "train.jsonl"), "--eval-input",
                                str(data / "eval.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--seq-len", "16",
                                "--out", str(data)], f"--out {data} holds --input {data / 'train.jsonl'}")
    _refused(capsys, tmp_path, ["report", "--run", str(run), "--out", str(run / "report")],
             f"--out {run / 'report'} is inside --run {run}")
    # a record file in the run's top folder is accepted (the documented report --out RUN/run_record.json)
    _refused(capsys, tmp_path, ["report", "--run", str(run), "--out", str(tmp_path / "file")],
             f"--out {tmp_path / 'file'} is a regular file")


# --------------------------------------------------------------------------- every folder a command writes

# (command words, the option naming the folder it writes, the rest of a command line that would run)
FOLDER_OUTPUTS = [
    (["data", "train-tokenizer"], "--out", ["--input", "{file}", "--vocab-size", "300"]),
    (["data", "tokenize"], "--out", ["--input", "{file}", "--source", "s", "--tokenizer", "{tmp}/tok", "--seq-len", "8",
                                     "--rows-per-shard", "4"]),
    (["data", "merge-parts"], "--out", ["{tmp}/s.part-0-of-1"]),
    (["data", "embedded"], "--out", []),
    (["sft", "build"], "--out", ["--input", "{file}", "--eval-input", "{file}", "--tokenizer", "{tmp}/tok",
                                 "--seq-len", "8"]),
    (["export"], "--out", ["--checkpoint", "{tmp}/ckpt"]),
    (["jobs", "render"], "--out", ["ds_configs/jobs/tiny.toml"]),
    (["demo"], "--root", []),
    (["smoke"], "--workdir", ["--config", "ds_configs/tiny/pretrain.yaml"]),
]


def _declared(parser, words=()) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Every (sub)command of ``parser`` that declares the folders it writes (outputs.writes_dirs)."""
    found = {}
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, sub in action.choices.items():
            if isinstance(sub, type(parser)):
                if sub.get_default("dir_options"):
                    found[(*words, name)] = sub.get_default("dir_options")
                found.update(_declared(sub, (*words, name)))
    return found


def test_every_command_that_writes_a_folder_declares_it():
    from ds_trhash.cli import build_parser

    assert _declared(build_parser()) == {tuple(words): (flag,) for words, flag, _ in FOLDER_OUTPUTS}


@pytest.mark.parametrize("words, flag, rest", FOLDER_OUTPUTS, ids=[" ".join(w) for w, _, _ in FOLDER_OUTPUTS])
def test_a_folder_output_that_is_a_file_is_refused_naming_the_option(tmp_path, capsys, words, flag, rest):
    file = tmp_path / "a-file"
    file.write_text("not a folder\n")
    args = [a.format(file=file, tmp=tmp_path) for a in rest]
    for target, how in ((file, "is a regular file"), (file / "below", f"lies below the regular file {file}")):
        before = tree_digest(tmp_path)
        assert main([*words, *args, flag, str(target)]) == 2
        err = capsys.readouterr().err
        assert f"error: {flag} {target} {how}, not a directory" in err and "Errno" not in err, err
        assert tree_digest(tmp_path) == before


def test_the_real_commands_say_which_option_or_key_names_a_file(tmp_path):
    from tests.fail_closed import assert_clean_refusal, ds_trhash

    file = tmp_path / "FILE"
    file.write_text("x")
    before = tree_digest(tmp_path)
    assert_clean_refusal(ds_trhash("data", "embedded", "--out", file), f"--out {file} is a regular file, not a directory")
    assert_clean_refusal(ds_trhash("jobs", "render", "ds_configs/jobs/tiny.toml", "--out", file),
                         f"--out {file} is a regular file, not a directory")
    assert tree_digest(tmp_path) == before
    manifest = tmp_path / "jobs.toml"
    manifest.write_text('version = 1\njobs_dir = "FILE"\n[[jobs]]\nname = "a"\nargv = ["true"]\n')
    before = tree_digest(tmp_path)
    for action in (["render", str(manifest), "--out", str(tmp_path / "conf")], ["status", str(manifest)]):
        assert_clean_refusal(ds_trhash("jobs", *action), "key 'jobs_dir'", f"{file} is a regular file, not a directory")
    assert tree_digest(tmp_path) == before
