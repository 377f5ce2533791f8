"""The loop's retry of a step that ran out of memory, in one process, on an engine with
DeepSpeed's accumulation contract: the step is abandoned (nothing applied), its rows read once and
trained again at the next smaller micro-batch, the same weights as without the failure; at
micro-batch 1 the run stops naming what else reduces memory, the weights untouched."""
import pytest
import torch

from ds_trhash.batch_layout import step_rows
from ds_trhash.training import loop
from ds_trhash.training.memory.step import MicroBatchFloor, retries_in_place
from tests.training.test_loop import TokenModel


class AccumulatingEngine:
    """What the loop asks of DeepSpeed's engine (ZeRO 0, one rank): micro-steps, the boundary
    flag, the accumulation it knows, and SGD applied at the boundary."""

    def __init__(self, module, grad_accum, micro_batch=2):
        self.module, self.ga, self.mb, self.micro_steps = module, grad_accum, micro_batch, 0
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        self._is_gradient_accumulation_boundary = None
        self.updates = 0

    def __call__(self, *a, **k):
        return self.module(*a, **k)

    def zero_optimization_stage(self):
        return 0

    def zero_optimization_partition_gradients(self):
        return False

    def managed_gradient_accumulation(self):
        return True

    def gradient_accumulation_steps(self):
        return self.ga

    def train_batch_size(self):
        return step_rows(self.mb, self.ga, 1)

    def set_train_micro_batch_size(self, micro_batch):
        self.mb = micro_batch

    def set_train_batch_size(self, rows):
        self.ga = rows // self.mb

    def set_gradient_accumulation_boundary(self, flag):
        self._is_gradient_accumulation_boundary = flag

    def allreduce_gradients(self):
        pass  # one rank

    def backward(self, loss, scale_wrt_gas=True):
        loss.backward()

    def zero_grad(self):
        for p in self.module.parameters():
            p.grad = None

    def step(self):
        flag = self._is_gradient_accumulation_boundary
        if flag if flag is not None else (self.micro_steps + 1) % self.ga == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.updates += 1
        self.micro_steps += 1


class Rows:
    """Step s: ``rows`` rows cut in micro-batches of ``cut``; counts the reads."""

    def __init__(self, rows=4, cut=2):
        self.rows, self.cut, self.reads = rows, cut, []

    def micro_batches(self, step):
        self.reads.append(step)
        ids = (torch.arange(self.rows * 5).reshape(self.rows, 5) * (step + 3)) % 7
        return [{"input_ids": ids[i:i + self.cut], "labels": (ids[i:i + self.cut] + 1) % 3}
                for i in range(0, self.rows, self.cut)]

    def epoch_of(self, step):
        return 0


class OutOfMemoryAt:
    def __init__(self, step, micro_step):
        self.at = (step, micro_step)

    def out_of_memory_due(self, step, micro_step):
        """Once, as DS_TRHASH_FAULT=oom_at_step on its rank."""
        if (step, micro_step) != self.at:
            return False
        self.at = None
        return True


class Retries(loop.Callback):
    def __init__(self):
        self.seen = []

    def on_retry(self, state, check, micro_batch):
        self.seen.append((check.step, check.failed_rank, check.micro_batch, micro_batch, state.micro_batch))


def _run(faults, rows=4, cut=2, steps=4, model=None):
    model, data, retries = model or TokenModel(), Rows(rows, cut), Retries()
    engine = AccumulatingEngine(model, rows // cut, cut)
    weights = []

    class Keep(loop.Callback):
        def on_step_end(self, state, metrics):
            weights.append(model.w.detach().clone())

    state = loop.run(engine, data, loop.TrainState(step=0, total_steps=steps), [retries, Keep()],
                     torch.device("cpu"), 1, lr_of=lambda: 0.1, faults=faults)
    return state, engine, data, retries, weights


def test_an_out_of_memory_micro_batch_is_retried_on_the_same_rows_at_the_next_smaller_size():
    assert retries_in_place(AccumulatingEngine(TokenModel(), 2))
    state, engine, data, retries, weights = _run(OutOfMemoryAt(2, 1))
    _, _, plain_data, _, plain = _run(None)
    assert retries.seen == [(2, 0, 2, 1, 1)] and state.micro_batch == 1
    assert engine.updates == 4 and engine.ga == 4  # one update per step; the accumulation follows
    assert data.reads == plain_data.reads == [0, 1, 2, 3]  # each step's rows read once
    for got, want in zip(weights, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_at_micro_batch_1_the_run_stops_naming_what_else_reduces_memory_and_nothing_moves():
    model = TokenModel()
    with pytest.raises(MicroBatchFloor, match="out of device memory at step 3 with micro-batch 1: .* "
                                              "model.activation_checkpointing: true, zero.stage 2") as err:
        _run(OutOfMemoryAt(3, 0), rows=1, cut=1, model=model)
    assert err.value.exit_code == 1
    _, _, _, _, plain = _run(None, rows=1, cut=1, steps=2)
    assert torch.equal(model.w.detach(), plain[-1])  # step 3 applied nothing
