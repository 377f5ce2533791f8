"""MetricsCallback: rows at step 1, every log_every steps, the last step and a stop, read back from metrics.csv."""
import csv

import torch

from ds_trhash.training.callbacks import MetricsCallback
from ds_trhash.training.records.expert_load import ExpertLoadWriter
from ds_trhash.training.loop import TrainState
from ds_trhash.training.records.metrics_csv import MetricsWriter
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


class CountingModel(fakes.Model):
    """Routes 2 tokens per step to expert (step % 2) of each of its 2 layers."""

    def __init__(self):
        super().__init__()
        self.counts = None

    def step(self, step):
        add = torch.zeros(2, 2, dtype=torch.long)
        add[:, step % 2] = 2
        self.counts = add if self.counts is None else self.counts + add

    def take_expert_load(self):
        counts, self.counts = self.counts, None
        return counts


def test_expert_load_rows_cover_the_steps_since_the_previous_row(tmp_path):
    """Rows at the metrics cadence, the stop, and right before each checkpoint, each with the
    routes of the steps since the previous row: a run that dies after logging step 8 and resumes
    from its checkpoint at step 6 (not a logged step) keeps every step counted exactly once."""
    def train(first, last, checkpoints=(), stop=None):
        model = CountingModel()
        run = fakes.run(tmp_path, cfg=fakes.config(log_every=4), model=model,
                        writer=MetricsWriter(tmp_path / "metrics.csv", rank=0, resume_step=first),
                        expert_load=ExpertLoadWriter(tmp_path / "expert_load.csv", num_experts=2, rank=0,
                                                     resume_step=first))
        cb = MetricsCallback.from_run(run)
        state = TrainState(step=first, total_steps=10)
        cb.on_start(state)
        for step in range(first + 1, last + 1):
            model.step(step)
            state.step, state.stop_requested = step, step == stop
            cb.on_step_end(state, fakes.metrics(step))
            if step in checkpoints or step == stop:
                cb.before_save(state)  # what CheckpointCallback.save calls on every callback first
        cb.close()

    train(0, 8, checkpoints=(3, 6))  # dies after logging step 8
    train(6, 10, stop=9)  # resumed from the checkpoint at step 6; a stop at 9
    with open(tmp_path / "expert_load.csv", newline="") as fh:
        rows = [(int(r["step"]), int(r["from_step"]), int(r["layer"]), int(r["expert_0"]), int(r["expert_1"]))
                for r in csv.DictReader(fh)]
    assert [r[:2] for r in rows if r[2] == 0] == [(1, 0), (3, 1), (4, 3), (6, 4), (8, 6), (9, 8), (10, 9)]
    assert rows[:2] == [(1, 0, 0, 0, 2), (1, 0, 1, 0, 2)]  # step 1: expert 1
    assert rows[2] == (3, 1, 0, 2, 2)  # steps 2 and 3: one even, one odd
    assert sum(r[3] + r[4] for r in rows if r[2] == 1) == 2 * 10  # every step counted once
