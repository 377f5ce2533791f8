"""Packed SFT batches as the loop sees them, and the proof that per-document packing isolates
examples: no token of one example can change another example's logits."""

import re
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, open_sft, pack
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.data.stream.reader import ReplayReader
from ds_trhash.data.stream.opening import open_corpus
from ds_trhash.data.stream.assembly import THREAD_NAME
from ds_trhash.data.stream.reader import ReaderError
from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.steps import RankStream, open_stream
from ds_trhash.training import loop
from ds_trhash.training.callbacks.base import Callback
from tests.training.test_loop import FakeEngine, TokenModel
from ds_trhash.training.data_loader import PretrainBatches, SFTStepBatches, byte_size, data_wait_line
from tests.data.hub_corpus import REPO, hub_corpus, plan_for, write_corpus  # noqa: F401  (the fixture)

SEQ = 128


@pytest.fixture(scope="module")
def partition(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("iso")
    train = write_jsonl(root / "train.jsonl", [{"messages": conversation(i)} for i in range(24)])
    ev = write_jsonl(root / "eval.jsonl", [{"messages": conversation(100 + i)} for i in range(3)])
    build_sft_dataset(train, ev, tokenizer_dir, SEQ, root / "sft")
    return open_sft(root / "sft", VOCAB_SIZE, SEQ).partition("train")


def _two_doc_window(partition, policy):
    packs = [p for p in pack(partition, SEQ, policy) if len(p.examples) >= 2]
    assert packs, "the fixture must pack at least two examples into one window"
    steps = SFTStepBatches(SFTBatches(packs, 1, 1, 0, seed=0), grad_accum=1, policy=policy)
    return steps.micro_batches(0)[0]


def _model():
    torch.manual_seed(0)
    cfg = TRHashConfig.from_preset("tiny", vocab_size=VOCAB_SIZE, max_seq_len=SEQ)
    return TRHashForCausalLM(cfg).eval()


def _perturb_first_document(batch):
    ids = batch["input_ids"].clone()
    doc = batch.get("document_ids")
    first = (doc[0] == doc[0, 0]) if doc is not None else torch.arange(ids.shape[1]) < 20
    first[0] = False  # keep the very first token, change the rest of document 1
    ids[0, first] = (ids[0, first] + 7) % VOCAB_SIZE
    return ids, first


def test_per_document_packing_isolates_examples(partition):
    batch = _two_doc_window(partition, "per_document")
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    model = _model()
    with torch.no_grad():
        extra = {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"]}
        ref = model(batch["input_ids"], **extra)
        ids, first = _perturb_first_document(batch)
        out = model(ids, **extra)
    others = ~(batch["document_ids"][0] == batch["document_ids"][0, 0])
    assert others.any() and first.any()
    assert torch.equal(ref[0, others], out[0, others])  # exactly: no path from doc 1 to doc 2
    assert not torch.equal(ref[0, first], out[0, first])


def test_cross_document_packing_lets_examples_attend_across(partition):
    batch = _two_doc_window(partition, "cross_document")
    assert set(batch) == {"input_ids", "labels"}  # release behaviour: plain causal window
    model = _model()
    with torch.no_grad():
        ref = model(batch["input_ids"])
        ids, first = _perturb_first_document(batch)
        out = model(ids)
    later = torch.arange(ids.shape[1]) > int(np.flatnonzero(first.numpy()).max())
    assert not torch.equal(ref[0, later], out[0, later])


def test_steps_follow_epochs_and_grad_accumulation(partition):
    packs = pack(partition, SEQ, "per_document")
    inner = SFTBatches(packs, micro_batch=1, world_size=1, rank=0, seed=3)
    steps = SFTStepBatches(inner, grad_accum=2, policy="per_document")
    assert steps.steps_per_epoch == inner.batches_per_epoch // 2
    spe = steps.steps_per_epoch
    assert [steps.epoch_of(s) for s in (0, spe - 1, spe, 2 * spe)] == [0, 0, 1, 2]
    second = steps.micro_batches(spe + 1)
    assert len(second) == 2
    assert torch.equal(second[1]["input_ids"], inner.batch(1, 3)["input_ids"])


def test_data_wait_line_adds_up_queue_waits_read_time_and_shard_waits(hub_corpus, tmp_path):
    """The stage-end line: the seconds the training thread waited for its batches, as a part of
    the step seconds; and the seconds assembling them took, split into reading rows and waiting
    for shards (downloads through the node cache among them), each a part of that whole, with
    the cache's own counts."""
    hub, _, doc = hub_corpus
    corpus = open_corpus(doc, f"hf://datasets/{REPO}")
    layout = BatchLayout(micro_batch=2, grad_accum=2, rank=0, world_size=1)
    with RankStream(ReplayReader(doc, None, 0, cache=corpus.open_cache(tmp_path / "cache", 2**30, prefetch=0)),
                    layout) as stream:
        batches = PretrainBatches(stream)
        batches.micro_batches(0)
        figures = batches.data_figures()
        line = data_wait_line(figures, 10.0, 1)
        stats = stream.reader.cache.stats()
    assert figures.queue_wait_s > 0 and figures.background
    assert line.startswith(f"data wait on rank 0: {figures.queue_wait_s:.3f} s of 10.000 s in 1 step(s) "), line
    found = re.search(r"assembling them took ([\d.]+) s in the background: ([\d.]+) s reading rows \(([\d.]+) %\), "
                      r"([\d.]+) s waiting for shards \(([\d.]+) %\)", line)
    whole, read, read_share, waited, wait_share = map(float, found.groups())
    assert abs(read + waited - whole) <= 0.0015 and abs(read_share + wait_share - 100.0) <= 0.15, line
    assert 0 < waited and stats["misses"] >= 1, line  # the shards came from the Hub on demand
    # the downloads in one figure: this process's bytes and their average rate over the step time;
    # once the stream closed, the bytes are exactly every entry of the fresh cache (each counted once)
    assert figures.downloaded_bytes > 0
    entries = [p for p in (tmp_path / "cache").rglob("*.bin") if p.is_file()]
    assert stream.figures().downloaded_bytes == sum(p.stat().st_size for p in entries)
    # the counts of the figures the line was made from (the stream may have read on since: the cache's own)
    assert figures.fetched >= 1 and figures.fetched + figures.hits <= stats["misses"] + stats["hits"]
    assert line.endswith(f"({figures.fetched} fetched on demand, 0 prefetched, {figures.hits} cache hits; "
                         f"downloaded {byte_size(figures.downloaded_bytes)} at "
                         f"{byte_size(figures.downloaded_bytes / 10.0)}/s)"), line
    assert data_wait_line(SFTStepBatches(None, 1, "cross_document").data_figures(), 10.0, 1) is None  # not streamed


def test_byte_sizes_are_said_in_the_largest_unit_that_keeps_them_at_least_one():
    assert [byte_size(n) for n in (0, 512, 1536, 3 * 2**20, 2.5 * 2**30)] == [
        "0 B", "512 B", "1.5 KiB", "3.0 MiB", "2.50 GiB"]


class _Exit(Callback):
    """Ends the stage at step 2 the way ``way`` says."""

    def __init__(self, way):
        self.way = way

    def on_step_end(self, state, metrics):
        if state.step == 2 and self.way == "stop":
            state.stop_requested = True
        elif state.step == 2 and self.way == "hook_error":
            raise RuntimeError("a callback bug")
        elif state.step == 2 and self.way == "interrupt":
            raise KeyboardInterrupt


class _FailingEngine(FakeEngine):
    def __call__(self, *a, **k):
        if self.backward_calls == 4:  # step 3 of grad_accum 2
            raise OSError("device lost")
        return super().__call__(*a, **k)


@pytest.mark.parametrize("way", ["end", "stop", "step_error", "hook_error", "data_error", "interrupt"])
def test_every_way_out_of_a_stage_closes_the_stream_and_leaves_no_thread(tmp_path, monkeypatch, way):
    """The trainer's run_stage (its own ``finally``) around a real loop over a real stream: the stage
    ends, is stopped, or fails in a step, a callback or the data; the assembly thread is gone and
    the cache closed every time (the callbacks close nothing of the data)."""
    from ds_trhash.training import trainer
    from ds_trhash.training.preparation.stage_data import StageData

    root = write_corpus(tmp_path / "corpus")
    doc = plan_for(root)
    steps = 12 + 2 if way == "data_error" else 6  # 48 rows, 4 per step: step 12 is past the plan
    layout = BatchLayout(micro_batch=2, grad_accum=2, rank=0, world_size=1)
    data = StageData(batches=None, total_steps=steps)
    opened = []

    def start(first_step):
        stream = open_stream(open_corpus(doc, str(root)), doc, 0, layout, tmp_path / "cache", 2**30, 1, end=steps,
                             first_step=first_step)
        opened.append(stream)
        data.batches, data.stop = PretrainBatches(stream), stream.close

    data.start = start
    plan = SimpleNamespace(data=data, output=SimpleNamespace(damaged=[], saved=None))
    monkeypatch.setattr(trainer, "plan_launch", lambda *a, **k: plan)

    def train(plan, rank, world, requests):
        engine = (_FailingEngine if way == "step_error" else FakeEngine)(TokenModel())
        return loop.run(engine, plan.data.batches, loop.TrainState(step=0, total_steps=steps), [_Exit(way)],
                        torch.device("cpu"), 1, lr_of=lambda: 0.1)

    monkeypatch.setattr(trainer, "_train_stage", train)
    raised = {"end": None, "stop": None, "step_error": OSError, "hook_error": RuntimeError,
              "data_error": ReaderError, "interrupt": KeyboardInterrupt}[way]
    if raised is None:
        state = trainer.run_stage(None, None, 0, 1)
        assert state.step == (2 if way == "stop" else steps)
    else:
        with pytest.raises(raised):
            trainer.run_stage(None, None, 0, 1)
    stream = opened[0]
    assert stream.closed and stream.reader.cache._closed and not stream.reader.cache._holding
    assert not [t for t in threading.enumerate() if t.name in (THREAD_NAME, "shard-prefetch") and t.is_alive()]
