"""The demo's summary helpers (the demo itself is `make demo`: the three stages are covered by
tests/training/test_sft_stage.py through the same launches)."""

from ds_trhash.demo import column, loss_range


def test_summary_reads_losses_and_eval_columns(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,train_loss,eval_loss\n0,,6.5\n1,8.3,\n2,7.1,\n2,,6.1\n")
    assert loss_range(csv) == (8.3, 7.1, 2)
    assert column(csv, "eval_loss") == [6.5, 6.1]

