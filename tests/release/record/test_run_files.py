"""The run folder's files a record reads: a missing file reads as nothing, a damaged number is
refused naming line and column, a piqa line cut short by a crash is skipped, and a checkpoint's
metrics are its step's eval row with the last train row at or before it."""
import pytest

from ds_trhash.release.record.run_files import (RecordError, checkpoint_metrics, number, read_json, read_metrics,
                                                read_piqa_rows)


def test_missing_or_damaged_json_reads_as_nothing(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "cut.json").write_text('{"a": ')
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert [read_json(tmp_path / n) for n in ("absent.json", "list.json", "cut.json", "ok.json")] == [None, None, None,
                                                                                                      {"a": 1}]


def test_numbers_keep_their_kind_and_a_damaged_cell_is_refused(tmp_path):
    assert (number("12"), number("1.5"), number("1e3"), number(""), number("x")) == (12, 1.5, 1000.0, None, None)
    metrics = tmp_path / "metrics.csv"
    assert read_metrics(metrics) == []
    metrics.write_text("step,train_loss,attn_backend\n1,nan,sdpa\n2,2.5,sdpa\n3,lots,sdpa\n")
    with pytest.raises(RecordError, match=r"line 4, column train_loss: 'lots' is not a number"):
        read_metrics(metrics)


def test_a_checkpoints_metrics_are_its_eval_row_and_the_last_train_row_before_it():
    rows = [{"step": "10", "train_loss": "3.0", "lr": "0.1"}, {"step": "20", "train_loss": "2.0", "lr": "0.05"},
            {"step": "20", "eval_loss": "2.2", "eval_ppl": "9.0"}, {"step": "30", "train_loss": "1.0"}]
    assert checkpoint_metrics(20, rows) == {"eval_loss": 2.2, "eval_ppl": 9.0, "train_loss": 2.0, "lr": 0.05,
                                            "train_row_step": 20}


def test_piqa_rows_by_step_the_last_one_kept_and_a_cut_line_skipped(tmp_path):
    piqa = tmp_path / "piqa.jsonl"
    assert read_piqa_rows(piqa) == {}
    piqa.write_text('{"step": 5, "acc": 0.5}\n{"step": 5, "acc": 0.6, "extra": 1}\n{"step": "x"}\n{"step": 9, "ac')
    assert read_piqa_rows(piqa) == {5: {"step": 5, "epoch": None, "acc": 0.6, "acc_norm": None, "n": None,
                                        "warning": None}}
