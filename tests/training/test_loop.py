"""The loop's loss normalisation: one mean over every supervised token of the optimizer step."""

import os

import pytest
import torch

from ds_trhash.training import loop
from ds_trhash.training.liveness.phases import Beacon


class TokenModel(torch.nn.Module):
    """Per-token loss = (w · x_t - y_t)^2 so that gradients are easy to compare exactly."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, input_ids, labels=None, reduction="mean"):
        x = torch.nn.functional.one_hot(input_ids % 3, 3).float()
        per_token = ((x @ self.w) - labels.clamp(min=0).float()) ** 2
        per_token = per_token * (labels != -100)
        return per_token.sum() if reduction == "sum" else per_token.sum() / (labels != -100).sum()


class FakeEngine:
    """DeepSpeed's contract as the loop uses it: forward, backward (accumulates), step."""

    def __init__(self, module):
        self.module = module
        self.backward_calls = 0

    def __call__(self, *a, **k):
        return self.module(*a, **k)

    def backward(self, loss, scale_wrt_gas=True):
        assert scale_wrt_gas is False
        loss.backward()
        self.backward_calls += 1

    def step(self):
        """The optimizer itself is not under test: gradients are compared before any update."""


def micro(ids, labels):
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])}


def test_step_loss_is_mean_over_all_supervised_tokens_not_mean_of_means():
    # micro-batch 1 supervises 1 token, micro-batch 2 supervises 3: a mean of means would
    # weight the lone token 3x more than the others.
    mbs = [micro([1, 2, 0, 1], [-100, -100, -100, 4]), micro([2, 2, 1, 0], [1, -100, 3, 2])]
    model = TokenModel()
    engine = FakeEngine(model)
    stats = loop.train_step(engine, mbs, torch.device("cpu"), world_size=1)
    grad_loop = model.w.grad.clone()

    ref = TokenModel()
    ids = torch.cat([m["input_ids"] for m in mbs], 1)
    labels = torch.cat([m["labels"] for m in mbs], 1)
    ref_loss = ref(ids, labels=labels, reduction="mean")
    ref_loss.backward()

    assert stats["supervised_tokens"] == 4
    assert stats["tokens"] == 8
    assert stats["loss"].item() == pytest.approx(ref_loss.item(), rel=1e-6)
    torch.testing.assert_close(grad_loop, ref.w.grad, rtol=0, atol=1e-6)

    mean_of_means = sum(TokenModel()(m["input_ids"], labels=m["labels"]).item() for m in mbs) / 2
    assert abs(mean_of_means - stats["loss"].item()) > 1e-3  # the two rules really differ here
    assert engine.backward_calls == 2


class ListBatches:
    def __init__(self, steps, per_epoch):
        self.steps, self.per_epoch = steps, per_epoch

    def micro_batches(self, step):
        return [micro([step % 3, 1], [1, 2])]

    def epoch_of(self, step):
        return step // self.per_epoch


class Recorder(loop.Callback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_start(self, state):
        self.events.append(("start", state.step))

    def on_step_end(self, state, metrics):
        self.events.append(("step", state.step, metrics["epoch"]))
        if self.stop_at == state.step:
            state.stop_requested = True

    def on_epoch_end(self, state):
        self.events.append(("epoch_end", state.step, state.epoch, state.epochs_done))

    def on_end(self, state):
        self.events.append(("end", state.step))


def test_run_fires_epoch_ends_at_boundaries_and_resumes_mid_run():
    rec = Recorder()
    state = loop.TrainState(step=0, total_steps=4)
    loop.run(FakeEngine(TokenModel()), ListBatches(4, 2), state, [rec], torch.device("cpu"), 1, lr_of=lambda: 0.1)
    # state.epoch: the epoch just finished (from 0); epochs_done and metrics["epoch"]: epochs completed
    assert ("epoch_end", 2, 0, 1) in rec.events and ("epoch_end", 4, 1, 2) in rec.events
    assert [e[2] for e in rec.events if e[0] == "step"] == [0, 1, 1, 2]
    assert rec.events[-1] == ("end", 4)

    rec2 = Recorder()
    state2 = loop.TrainState(step=3, total_steps=4)
    loop.run(FakeEngine(TokenModel()), ListBatches(4, 2), state2, [rec2], torch.device("cpu"), 1, lr_of=lambda: 0.1)
    assert rec2.events == [("start", 3), ("step", 4, 2), ("epoch_end", 4, 1, 2), ("end", 4)]


def test_stop_request_ends_after_the_current_step():
    rec = Recorder(stop_at=2)
    state = loop.TrainState(step=0, total_steps=10)
    loop.run(FakeEngine(TokenModel()), ListBatches(10, 100), state, [rec], torch.device("cpu"), 1, lr_of=lambda: 0.1)
    assert state.step == 2 and state.stop_requested


def test_label_sanity_counts_and_out_of_range_labels_fail_closed():
    mbs = [micro([1, 2, 0, 1], [-100, 5, 2, 1])]
    assert loop.label_counts(mbs, vocab_size=6) == (3, 1, 0)
    assert loop.label_counts(mbs, vocab_size=5) == (2, 1, 1)
    stats = loop.train_step(FakeEngine(TokenModel()), mbs, torch.device("cpu"), 1, vocab_size=6)
    assert (stats["label_valid"], stats["label_ignored"], stats["label_out_of_range"]) == (3, 1, 0)
    with pytest.raises(loop.LabelError, match="1 label"):
        loop.train_step(FakeEngine(TokenModel()), mbs, torch.device("cpu"), 1, vocab_size=5)


def _rank_worker(rank, world, port, mbs_by_rank, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = TokenModel()

        class AveragingEngine(FakeEngine):
            """DeepSpeed's data parallelism: gradients averaged over ranks at the step."""

            def step(self):
                for p in self.module.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world

        stats = loop.train_step(AveragingEngine(model), mbs_by_rank[rank], torch.device("cpu"), world)
        out[rank] = (stats["loss"].item(), model.w.grad.clone())
        dist.barrier()  # both ranks done before gloo is torn down
    finally:
        dist.destroy_process_group()


def test_two_ranks_normalise_by_the_supervised_tokens_of_the_whole_step():
    import torch.multiprocessing as mp

    from tests.training.launch_utils import free_port

    # rank 0 supervises 1 token, rank 1 supervises 4: the mean must weight every token equally
    mbs_by_rank = [[micro([1, 2, 0, 1], [-100, -100, -100, 4])], [micro([2, 2, 1, 0], [1, 0, 3, 2])]]
    out = mp.Manager().dict()
    mp.spawn(_rank_worker, args=(2, free_port(), mbs_by_rank, out), nprocs=2, join=True)

    ref = TokenModel()
    ids = torch.cat([m["input_ids"] for r in mbs_by_rank for m in r], 1)
    labels = torch.cat([m["labels"] for r in mbs_by_rank for m in r], 1)
    ref_loss = ref(ids, labels=labels, reduction="mean")
    ref_loss.backward()
    for rank in (0, 1):
        loss, grad = out[rank]
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
        torch.testing.assert_close(grad, ref.w.grad, rtol=0, atol=1e-6)


class SyncCounter:
    """Counts the Tensor methods that copy a value to the host (a device sync on CUDA)."""

    NAMES = ("item", "tolist", "__float__")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton experts need CUDA or, on CPU, the interpreter")
def test_a_step_reads_nothing_back_from_the_device_until_a_callback_logs(monkeypatch):
    """The tiny model with the Triton experts (the GPU path; interpreter on CPU) and packed
    documents: the steps copy no value to the host; the loss is read once per logged step."""
    from ds_trhash.model import TRHashConfig, TRHashForCausalLM

    torch.manual_seed(0)
    # narrow, so the Triton interpreter keeps this to seconds
    model = TRHashForCausalLM(TRHashConfig.from_preset("tiny", num_layers=1, hidden_size=32, num_heads=2,
                                                       num_kv_heads=1, head_dim=16, shared_width=32, vocab_size=512))
    model.set_backends(experts="triton")
    ids = torch.randint(0, 512, (1, 16))
    mb = {"input_ids": ids, "labels": ids.roll(-1, 1), "document_ids": torch.tensor([[0] * 6 + [1] * 10])}

    class Batches:
        def micro_batches(self, step):
            return [mb, mb]  # two micro-batches per step

        def epoch_of(self, step):
            return 0

    class LogEvery2(loop.Callback):
        def __init__(self):
            self.rows = []

        def on_step_end(self, state, metrics):
            if state.step % 2 == 0:
                self.rows.append((state.step, metrics["loss"], metrics["ppl"]))

    log = LogEvery2()
    counter = SyncCounter(monkeypatch)
    state = loop.run(FakeEngine(model), Batches(), loop.TrainState(step=0, total_steps=2), [log],
                     torch.device("cpu"), 1, lr_of=lambda: 0.1)
    monkeypatch.undo()
    assert state.step == 2 and [r[0] for r in log.rows] == [2]
    # one read (loss and grad norm together) for the one logged step, none per layer
    assert len(counter.calls) == 1, counter.calls
    assert all(isinstance(r[1], float) and r[2] > 1 for r in log.rows)


# ----------------------------------------------------------------------------- the callbacks' lifecycle


def _open_files() -> set[str]:
    """Paths this process holds open (Linux /proc)."""
    import os

    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return found


class FailingBatches(ListBatches):
    """A shard that cannot be read at ``fail_at``: the step raises, as a real reader would."""

    def __init__(self, steps, per_epoch, fail_at):
        super().__init__(steps, per_epoch)
        self.fail_at = fail_at

    def micro_batches(self, step):
        if step == self.fail_at:
            raise OSError(f"shard of step {step} is unreadable")
        return super().micro_batches(step)


class Lifecycle(loop.Callback):
    """Records on_error and close; ``raise_in`` makes one hook fail."""

    def __init__(self, log, name, raise_in=None):
        self.log, self.name, self.raise_in = log, name, raise_in

    def on_step_end(self, state, metrics):
        if self.raise_in == "on_step_end" and state.step == 2:
            raise RuntimeError("a callback bug")

    def on_error(self, exc):
        self.log.append((self.name, "on_error", type(exc).__name__))

    def close(self):
        self.log.append((self.name, "close"))
        if self.raise_in == "close":
            raise RuntimeError("close failed")


@pytest.mark.parametrize("failure", ["step", "hook"])
def test_an_exception_in_the_loop_still_closes_every_callback(tmp_path, failure):
    """Records flushed and closed, the live display stopped, and every callback told through
    on_error, whether the step or a callback's hook raised (the shard cache is the data layer's
    to close: tests/data/stream/delivery/test_steps.py)."""
    import io

    from rich.console import Console

    from ds_trhash.training.callbacks import MetricsCallback, ProgressCallback, make_callbacks
    from ds_trhash.training.display import Progress
    from ds_trhash.training.records.expert_load import ExpertLoadWriter
    from ds_trhash.training.records.metrics_csv import MetricsWriter
    from tests.training.callbacks import fakes

    class Model(fakes.Model):
        def take_expert_load(self):
            return None  # nothing counted: the expert-load file keeps its header only

    events = []
    progress = Progress("pretraining", 5, rank=0, every=1, console=Console(file=io.StringIO(), force_terminal=True))
    assert progress.live
    run = fakes.run(tmp_path, cfg=fakes.config(log_every=1), model=Model(), progress=progress,
                    writer=MetricsWriter(tmp_path / "metrics.csv", rank=0),
                    expert_load=ExpertLoadWriter(tmp_path / "expert_load.csv", num_experts=2, rank=0))
    callbacks = make_callbacks([
        lambda r: Lifecycle(events, "first", raise_in="on_step_end" if failure == "hook" else None),
        MetricsCallback.from_run, ProgressCallback.from_run, lambda r: Lifecycle(events, "last", raise_in="close"),
    ], run)
    batches = FailingBatches(5, 100, fail_at=2 if failure == "step" else None)
    expected = OSError if failure == "step" else RuntimeError
    with pytest.raises(expected, match="unreadable" if failure == "step" else "a callback bug"):
        loop.run(FakeEngine(TokenModel()), batches, loop.TrainState(step=0, total_steps=5), callbacks,
                 torch.device("cpu"), 1, lr_of=lambda: 0.1)

    name = expected.__name__
    assert events == [("first", "on_error", name), ("last", "on_error", name), ("first", "close"), ("last", "close")]
    assert not progress.live  # the display stopped
    assert not {str(tmp_path / "metrics.csv"), str(tmp_path / "expert_load.csv")} & _open_files()
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    # every row written before the failure is on disk (the hook failed in step 2 before its row)
    assert [r.split(",")[0] for r in rows[1:]] == (["1", "2"] if failure == "step" else ["1"])


def test_a_failing_close_does_not_keep_the_others_open(tmp_path):
    events = []
    callbacks = [Lifecycle(events, "a", raise_in="close"), Lifecycle(events, "b")]
    with pytest.raises(RuntimeError, match="close failed"):
        loop.run(FakeEngine(TokenModel()), ListBatches(2, 100), loop.TrainState(step=0, total_steps=2), callbacks,
                 torch.device("cpu"), 1, lr_of=lambda: 0.1)
    assert events == [("a", "close"), ("b", "close")]  # no on_error: the stage itself ended


class Places(loop.Callback):
    """Where the liveness beacon says this rank is, seen from each hook; a second callback of
    another phase shows each hook has a place of its own."""

    def __init__(self, beacon, phase=None):
        self.beacon, self.seen = beacon, []
        if phase:
            self.phase = phase

    def on_start(self, state):
        self.seen.append(("start", self.beacon.step, self.beacon.mark, self.beacon.phase))

    def on_step_end(self, state, metrics):
        self.seen.append(("step", self.beacon.step, self.beacon.mark, self.beacon.phase))

    def on_end(self, state):
        self.seen.append(("end", self.beacon.step, self.beacon.mark, self.beacon.phase))


def test_the_liveness_beacon_follows_every_place_of_a_step_in_order():
    from_data: list = []

    class Watched(ListBatches):
        def micro_batches(self, step):
            from_data.append((beacon.step, beacon.mark, beacon.phase))
            return super().micro_batches(step)

    beacon = Beacon()
    first, second = Places(beacon), Places(beacon, phase="checkpoint")
    loop.run(FakeEngine(TokenModel()), Watched(2, 100), loop.TrainState(step=0, total_steps=2), [first, second],
             torch.device("cpu"), 1, lr_of=lambda: 0.1, beacon=beacon)
    assert from_data == [(1, 0, "data_wait"), (2, 0, "data_wait")]
    assert first.seen == [("start", 0, 3, "step_end"), ("step", 1, 3, "step_end"), ("step", 2, 3, "step_end"),
                          ("end", 2, 1_000_000, "end")]
    assert second.seen == [("start", 0, 4, "checkpoint"), ("step", 1, 4, "checkpoint"), ("step", 2, 4, "checkpoint"),
                           ("end", 2, 1_000_001, "end")]
