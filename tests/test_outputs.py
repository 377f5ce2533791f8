"""Output paths that would write into what a command reads, or that cannot be directories, are
refused before anything is written, naming both paths: the helpers, then `export --out`,
`sft build --out` and `report --out` through the real commands."""

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
    _refused(capsys, tmp_path, ["report", "--run", str(run), "--out", str(run / "record.json")],
             f"--out {run / 'record.json'} is inside --run {run}")
    _refused(capsys, tmp_path, ["report", "--run", str(run), "--out", str(tmp_path / "file")],
             f"--out {tmp_path / 'file'} is a regular file")
