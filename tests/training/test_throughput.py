"""The launch's steady tokens/s: warm-up steps and steps that saved a checkpoint stay out of it."""
import torch

from ds_trhash.training import loop
from ds_trhash.training.callbacks import CheckpointCallback, ProgressCallback
from ds_trhash.training.throughput import SteadyRate
from tests.training.callbacks import fakes
from tests.training.test_loop import FakeEngine, ListBatches, TokenModel


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_warm_up_and_paused_intervals_stay_out_of_the_steady_rate():
    clock = Clock()
    rate = SteadyRate(warmup=2, clock=clock)
    rate.start()
    for step, seconds, pauses in [(1, 30.0, []), (2, 3.0, []), (3, 1.0, []), (4, 9.0, ["checkpoint"]),
                                  (5, 1.0, []), (6, 2.0, ["eval", "checkpoint"]), (7, 2.0, [])]:
        clock.now += seconds
        rate.note(step, 100, pauses)
    assert rate.rate == 300 / 4.0  # steps 3, 5, 7
    assert (rate.first_steady, rate.last_steady, rate.steady_steps) == (3, 7, 3)
    assert rate.paused == {"checkpoint": 2, "eval": 1}
    assert rate.overall == 700 / 48.0
    assert rate.describe() == ("throughput: steady 75 tokens/s over 3 steps (3-7; left out: 2 warm-up, "
                               "2 checkpoint, 1 eval); 15 tokens/s over all 7 steps of this launch")
    assert SteadyRate(warmup=2).describe() is None  # nothing steady measured yet


class SlowSaves(fakes.Engine):
    """A checkpoint save that takes 50 s of the training thread."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def save_checkpoint(self, path, tag):
        self.clock.now += 50.0
        super().save_checkpoint(path, tag)


class Tick(loop.Callback):
    """Each step costs one second of wall time."""

    def __init__(self, clock):
        self.clock = clock

    def on_step_end(self, state, metrics):
        self.clock.now += 1.0


def test_a_step_that_saves_a_checkpoint_does_not_lower_the_steady_rate(tmp_path):
    clock = Clock()
    run = fakes.run(tmp_path, cfg=fakes.config(every_steps=3), engine=SlowSaves(clock))
    callbacks = [Tick(clock), ProgressCallback(run.progress, run.model, every=1), CheckpointCallback.from_run(run)]
    state = loop.TrainState(step=0, total_steps=8, throughput=SteadyRate(warmup=1, clock=clock))
    loop.run(FakeEngine(TokenModel()), ListBatches(8, 100), state, callbacks, torch.device("cpu"), 1,
             lr_of=lambda: 0.1)
    # 2 tokens a step, 1 s a step: the saves at steps 3 and 6 (50 s each) and the final one (after
    # the last step, in on_end) change nothing of it
    assert state.throughput.rate == 2.0
    assert state.throughput.paused == {"checkpoint": 2} and state.throughput.steady_steps == 5
    assert state.throughput.overall == 16 / 108.0
    # the progress line shows the steady rate once there is one (step 3 shows steps 2's interval)
    shown = [u[3] for u in run.progress.updates]
    assert shown[2:] == [2.0] * 6
    assert "steady 2 tokens/s over 5 steps" in state.throughput.describe()
