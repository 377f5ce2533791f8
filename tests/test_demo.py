"""The demo's summary helpers (the demo itself is `make demo`: the three stages are covered by
tests/training/test_sft_stage.py through the same launches)."""

from ds_trhash.demo import column, loss_range


def test_summary_reads_losses_and_eval_columns(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train_loss,eval_loss\n0,,6.5\n1,8.3,\n2,7.1,\n2,,6.1\n")
    assert loss_range(csv) == (8.3, 7.1, 2)
    assert column(csv, "eval_loss") == [6.5, 6.1]


def test_demo_over_an_earlier_users_run_refuses_before_launching_and_deletes_nothing(tmp_path, capsys):
    from ds_trhash.cli import main
    from tests.fail_closed import tree_digest

    run = tmp_path / "R" / "tiny-pretrain"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,train_loss\n1,9.0\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "file").write_text("x")
    before = tree_digest(tmp_path)
    assert main(["demo", "--root", str(tmp_path / "R"), "--configs", str(tmp_path / "configs")]) == 2
    assert "lacks pretrain.yaml, refine.yaml, sft.yaml" in capsys.readouterr().err
    assert main(["demo", "--root", str(tmp_path / "R")]) == 2  # the shipped configs: the run itself refuses
    err = capsys.readouterr().err
    assert f"the stage directory {run} is not empty and was not made by ds-trhash demo" in err
    assert main(["demo", "--root", str(tmp_path / "file")]) == 2
    assert "--root" in capsys.readouterr().err
    assert tree_digest(tmp_path) == before
