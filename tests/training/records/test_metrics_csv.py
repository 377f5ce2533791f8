"""metrics.csv: fixed columns, rank 0 only, resume-safe appends."""
import csv
import math

import pytest

from ds_trhash.training.records.metrics_csv import COLUMNS, MetricsError, MetricsWriter, perplexity


def rows(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_header_and_rows_with_empty_cells(tmp_path):
    path = tmp_path / "run" / "metrics.csv"
    with MetricsWriter(path, rank=0) as w:
        w.write(step=0, epoch=0, eval_loss=1.722610, eval_tokens=12345)
        w.write(step=1, epoch=0.25, train_loss=2.0, lr=2e-5, tok_s=1234.56, tokens_seen=4096,
                supervised_tokens=1000, label_valid=1000, label_ignored=3096, label_out_of_range=0,
                experts_backend="pytorch", loss_backend="chunked", norm_backend="pytorch")
        assert len(rows(path)) == 2  # flushed per row, readable while the writer is open
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    first, second = rows(path)
    assert first["eval_loss"] == "1.722610" and first["eval_ppl"] == f"{math.exp(1.72261):.4f}"
    assert first["train_loss"] == "" and first["lr"] == "" and first["experts_backend"] == ""
    assert second["train_ppl"] == f"{math.exp(2.0):.4f}" and second["eval_ppl"] == ""
    assert float(second["lr"]) == 2e-5 and second["tok_s"] == "1234.6" and second["epoch"] == "0.2500"
    assert second["loss_backend"] == "chunked" and second["label_out_of_range"] == "0"


def test_perplexity_is_capped():
    assert perplexity(0.0) == 1.0
    assert math.isfinite(perplexity(1e6)) and perplexity(1e6) == perplexity(100.0)
    assert perplexity(None) is None and perplexity(float("nan")) is None


def test_other_ranks_write_nothing(tmp_path):
    path = tmp_path / "metrics.csv"
    w = MetricsWriter(path, rank=1)
    w.write(step=1, train_loss=1.0)
    w.close()
    assert not path.exists()


def test_unknown_column_is_an_error_on_every_rank(tmp_path):
    for rank in (0, 1):
        w = MetricsWriter(tmp_path / f"m{rank}.csv", rank=rank)
        with pytest.raises(MetricsError, match="train_los"):
            w.write(step=1, train_los=1.0)
        w.close()


def test_resume_appends_under_the_same_header(tmp_path):
    path = tmp_path / "metrics.csv"
    with MetricsWriter(path, 0) as w:
        w.write(step=1, train_loss=3.0)
    with MetricsWriter(path, 0) as w:
        w.write(step=2, train_loss=2.5)
    text = path.read_text()
    assert text.count("step,epoch") == 1
    assert [r["step"] for r in rows(path)] == ["1", "2"]


def test_a_different_header_is_refused(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss\n1,2.0\n")
    with pytest.raises(MetricsError, match="refusing to mix"):
        MetricsWriter(path, 0)
    assert path.read_text() == "step,loss\n1,2.0\n"  # untouched


def test_resume_step_drops_rows_logged_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.csv"
    with MetricsWriter(path, 0) as w:
        for step in range(1, 8):
            w.write(step=step, train_loss=1.0 / step)
    with MetricsWriter(path, 0, resume_step=5) as w:
        w.write(step=6, train_loss=0.5)
    assert [r["step"] for r in rows(path)] == ["1", "2", "3", "4", "5", "6"]
    assert rows(path)[-1]["train_loss"] == "0.500000"


def test_row_torn_by_a_crash_is_dropped(tmp_path):
    path = tmp_path / "metrics.csv"
    with MetricsWriter(path, 0) as w:
        w.write(step=1, train_loss=1.0)
    with open(path, "a") as fh:
        fh.write("2,,0.9")  # crash mid-row: no newline
    with MetricsWriter(path, 0) as w:
        w.write(step=2, train_loss=0.9)
    assert [r["step"] for r in rows(path)] == ["1", "2"]
    with open(path, newline="") as fh:
        assert all(len(r) == len(COLUMNS) for r in csv.reader(fh))


def test_bool_values_are_refused(tmp_path):
    with MetricsWriter(tmp_path / "m.csv", 0) as w, pytest.raises(MetricsError, match="bool"):
        w.write(step=1, label_valid=True)
