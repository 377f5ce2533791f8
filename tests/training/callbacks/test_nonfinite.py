"""The divergence guard in the real loop: a non-finite step stops the run naming the step before
any checkpoint of it could be written, without a host read per step; skip_step skips such steps
(weights unchanged) and stops after training.nonfinite_max_skips in a row."""

import math

import pytest
import torch

from ds_trhash.training import loop
from ds_trhash.training.callbacks.nonfinite import NonFiniteError, NonFiniteGuard


class Poisoned(torch.nn.Module):
    """loss = factor * sum((w · x - y)^2): a NaN factor makes the loss and every gradient NaN."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, input_ids, labels=None, reduction="sum", factor=None):
        x = torch.nn.functional.one_hot(input_ids % 3, 3).float()
        return factor.reshape(()) * (((x @ self.w) - labels.float()) ** 2).sum()


class SGDEngine:
    """forward / backward / step as DeepSpeed's engine; step applies plain SGD at the group's lr."""

    def __init__(self, module, lr=0.01):
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)

    def __call__(self, *a, **k):
        return self.module(*a, **k)

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()
        for g in self.optimizer.param_groups:
            g["lr"] = 0.01  # the scheduler's next rate


class Batches:
    def __init__(self, bad_steps):
        self.bad = set(bad_steps)  # 1-based optimizer steps whose batch is poisoned

    def micro_batches(self, step):
        factor = float("nan") if step + 1 in self.bad else 1.0
        return [{"input_ids": torch.tensor([[0, 1, 2]]), "labels": torch.tensor([[1, 0, 1]]),
                 "factor": torch.tensor([factor])}]

    def epoch_of(self, step):
        return 0


class Saver(loop.Callback):
    """Saves every step, running the guard's before-save hook first as the checkpoint callback does."""

    def __init__(self, guard, module):
        self.guard, self.module, self.saved = guard, module, []

    def on_step_end(self, state, metrics):
        self.guard.before_save(state)
        self.saved.append((state.step, self.module.w.detach().clone()))


def _run(guard, bad, steps=8, callbacks=()):
    model = Poisoned()
    for cb in callbacks:
        if isinstance(cb, Saver):
            cb.module = model
    state = loop.TrainState(step=0, total_steps=steps)
    loop.run(SGDEngine(model), Batches(bad), state, [g for g in (guard,) if g is not None] + list(callbacks),
             torch.device("cpu"), 1, lr_of=lambda: 0.01)
    return model, state, callbacks


def test_a_non_finite_step_stops_the_run_naming_it_and_nothing_of_it_is_saved():
    guard = NonFiniteGuard("stop", check_every=4)
    saver = Saver(guard, None)
    with pytest.raises(NonFiniteError, match="not finite at step 3; the run stops without saving"):
        _run(guard, bad={3}, callbacks=[saver])
    assert [s for s, _ in saver.saved] == [1, 2]
    assert all(torch.isfinite(w).all() for _, w in saver.saved)


def test_the_check_step_stops_a_run_that_saves_nothing():
    guard = NonFiniteGuard("stop", check_every=4)
    with pytest.raises(NonFiniteError, match="at step 2"):
        _run(guard, bad={2, 3}, callbacks=[loop.Callback()])


def test_the_guard_adds_no_host_read_per_step(monkeypatch):
    from tests.training.test_loop import SyncCounter

    class LogEvery2(loop.Callback):
        def on_step_end(self, state, metrics):
            if state.step % 2 == 0:
                metrics["loss"]

    reads = []
    for guard in (None, NonFiniteGuard("stop", check_every=2)):
        counter = SyncCounter(monkeypatch)
        _run(guard, bad=(), steps=4, callbacks=[LogEvery2()])
        monkeypatch.undo()
        reads.append(len(counter.calls))
    assert reads[0] == reads[1] == 2  # one read per logged step, with or without the guard


def test_skip_step_skips_a_bad_step_and_stops_after_max_skips_in_a_row():
    messages = []
    guard = NonFiniteGuard("skip_step", max_skips=3, log=messages.append)
    saver = Saver(guard, None)
    model, state, _ = _run(guard, bad={3}, steps=5, callbacks=[saver])
    assert state.step == 5 and guard.skipped == 1
    weights = dict(saver.saved)
    assert torch.equal(weights[3], weights[2]) and not torch.equal(weights[4], weights[3])  # step 3 moved nothing
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert messages == ["step 3: the loss or the gradient norm is not finite; step skipped (weights unchanged), "
                        "1 in a row, 1 skipped in all"]
    guard = NonFiniteGuard("skip_step", max_skips=3)
    with pytest.raises(NonFiniteError, match="3 steps in a row up to step 6 .* 4 step.s. skipped in all"):
        _run(guard, bad={2, 4, 5, 6}, steps=8, callbacks=[loop.Callback()])


def test_an_infinite_grad_norm_from_deepspeed_counts_too():
    guard = NonFiniteGuard("stop")
    guard.record(1, torch.tensor(1.0), 2.0)
    guard.record(2, torch.tensor(1.0), math.inf)
    guard.record(3, torch.tensor(math.nan), None)
    with pytest.raises(NonFiniteError, match="at step 2"):
        guard.check()
    fp16 = NonFiniteGuard("stop", check_grad_norm=False)  # DeepSpeed's loss scaler skips overflows itself
    fp16.record(1, torch.tensor(1.0), math.inf)
    fp16.check()
