"""MetricsCallback: rows at step 1, every log_every steps, the last step and a stop, read back from metrics.csv."""
import csv

from ds_trhash.training.callbacks import MetricsCallback
from ds_trhash.training.loop import TrainState
from ds_trhash.training.metrics import MetricsWriter
from tests.training.callbacks import fakes


def test_rows_at_the_cadence_first_last_and_stop(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.csv", rank=0)
    cb = MetricsCallback.from_run(fakes.run(tmp_path, cfg=fakes.config(log_every=4), writer=writer))
    state = TrainState(step=0, total_steps=10)
    for step in range(1, 11):
        state.step = step
        state.stop_requested = step == 6
        cb.on_step_end(state, fakes.metrics(step, loss=10.0 - step))
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == [1, 4, 6, 8, 10]
    assert float(rows[-1]["train_loss"]) == 0.0 and rows[0]["experts_backend"] == "pytorch"
