"""The stage's data loader: the declared interface and its contract, packed SFT batches as the
loop sees them (and the proof that per-document packing isolates examples: no token of one
example can change another example's logits), the stream's figures, and the pretraining
stream's lifetime from ``open`` to the trainer's ``finally``."""

import dataclasses
import re
import threading
import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, open_sft, pack
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.data.stream.delivery import (DEFAULT_PREFETCH_S, THREAD_NAME, DataFigures, RankStream, ReaderError,
                                           ReplayReader)
from ds_trhash.data.stream.corpus import open_corpus
from ds_trhash.batch_layout import BatchLayout
from ds_trhash.training import loop, trainer
from ds_trhash.training.callbacks.base import Callback
from ds_trhash.data.stage import DataLoader, PretrainLoader, SFTLoader, StreamRecipe
from ds_trhash.training.display import byte_size, data_wait_line
from ds_trhash.data.stage import StageData
from tests.training.test_loop import FakeEngine, TokenModel
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
    steps = SFTLoader(SFTBatches(packs, 1, 1, 0, seed=0), grad_accum=1, policy=policy)
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
    steps = SFTLoader(inner, grad_accum=2, policy="per_document")
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
        stream.micro_batches(0)
        figures = stream.figures()
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
    assert data_wait_line(None, 10.0, 1) is None  # not streamed (an SFT loader's figures)


def _recipe(tmp_path, steps, micro_batch=2, grad_accum=2):
    """A one-rank stream of the local tiny corpus (12 steps of 4 rows) through a cache of its own."""
    root = write_corpus(tmp_path / "corpus")
    doc = plan_for(root)
    return StreamRecipe(corpus=open_corpus(doc, str(root)), plan=doc, seed=0,
                        layout=BatchLayout(micro_batch=micro_batch, grad_accum=grad_accum, rank=0, world_size=1),
                        cache_dir=tmp_path / "cache", max_bytes=2**30, ranks_on_node=1, end=steps,
                        prefetch_s=DEFAULT_PREFETCH_S)


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
    steps = 12 + 2 if way == "data_error" else 6  # 48 rows, 4 per step: step 12 is past the plan
    loader = PretrainLoader(_recipe(tmp_path, steps))
    plan = SimpleNamespace(data=StageData(loader=loader, total_steps=steps),
                           output=SimpleNamespace(damaged=[], saved=None))
    monkeypatch.setattr(trainer, "plan_launch", lambda *a, **k: plan)

    def train(plan, rank, world, requests):
        engine = (_FailingEngine if way == "step_error" else FakeEngine)(TokenModel())
        return loop.run(engine, plan.data.loader, loop.TrainState(step=0, total_steps=steps), [_Exit(way)],
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
    stream = loader.stream
    assert stream.closed and stream.reader.cache._closed and not stream.reader.cache._holding
    assert not [t for t in threading.enumerate() if t.name in (THREAD_NAME, "shard-prefetch") and t.is_alive()]


def test_a_pretraining_loader_reads_only_between_open_and_close(tmp_path):
    """Built complete from its recipe, it reads nothing (no cache folder) until ``open``; batches
    asked before are refused with what to do; ``close`` is safe before ``open`` and twice."""
    loader = PretrainLoader(_recipe(tmp_path, 6))
    loader.close()  # nothing opened: nothing to close
    assert loader.stream is None and not (tmp_path / "cache").exists()
    with pytest.raises(RuntimeError, match=r"not open: call open\(first_step\) before asking for batches"):
        loader.micro_batches(0)
    with pytest.raises(RuntimeError, match="not open"):
        loader.readiness(0)
    assert loader.figures() is None and loader.steps_per_epoch is None and loader.epoch_of(5) == 0
    assert loader.cursor(3) == 3 * 4  # the global row the step starts at, known before any read
    loader.open(2)
    try:
        with pytest.raises(RuntimeError, match="already open"):
            loader.open(2)
        step = loader.micro_batches(2)
        assert [sorted(mb) for mb in step] == [["input_ids", "labels"]] * 2
        assert step[0]["input_ids"].shape == (2, 8)
        loader.wait_read(3, 30)  # the next step, read in the background: ready once read
        assert loader.readiness(3) == (0, 0, 0)
        figures = loader.figures()
        assert isinstance(figures, DataFigures) and figures.cached and figures.steps == 1
        assert (tmp_path / "cache").is_dir()
    finally:
        loader.close()
    loader.close()  # twice: fine
    assert loader.stream.closed
    with pytest.raises(RuntimeError, match="closed"):
        loader.micro_batches(3)


def test_an_sft_loader_has_nothing_to_open_and_is_always_ready(partition):
    """The interface's defaults: in-memory windows need no ``open`` (nor ``close``), are never
    waited for by the stop agreement and report no stream figures."""
    inner = SFTBatches(pack(partition, SEQ, "cross_document"), micro_batch=1, world_size=1, rank=0, seed=0)
    loader = SFTLoader(inner, grad_accum=2, policy="cross_document")
    first = loader.micro_batches(0)  # no open needed
    loader.open(0)
    loader.close()
    loader.close()
    assert torch.equal(loader.micro_batches(0)[1]["input_ids"], first[1]["input_ids"])
    assert loader.readiness(1) == (0, 0, 0) and loader.agreed(1, 0, 0) is None and loader.figures() is None
    assert loader.steps_per_epoch == inner.batches_per_epoch // 2 and loader.cursor(3) == 6


def test_the_interface_declares_what_the_loop_and_the_trainer_call():
    """A loader that leaves out one of the abstract methods cannot be made: the loop's
    ``micro_batches`` / ``epoch_of``, the checkpoint's ``cursor``, the checkpoint plan's ``steps_per_epoch``."""
    assert DataLoader.__abstractmethods__ == {"micro_batches", "epoch_of", "cursor", "steps_per_epoch"}

    class NoCursor(DataLoader):
        steps_per_epoch = None

        def micro_batches(self, step):
            return []

        def epoch_of(self, step):
            return 0

    with pytest.raises(TypeError, match="cursor"):
        NoCursor()
    assert issubclass(PretrainLoader, DataLoader) and issubclass(SFTLoader, DataLoader)


def _names_object(hint) -> bool:
    return hint is object or any(_names_object(arg) for arg in typing.get_args(hint))


@pytest.mark.parametrize("cls", [StageData, StreamRecipe, PretrainLoader, SFTLoader])
def test_the_stage_data_and_the_loaders_declare_every_field_with_a_type(cls):
    """House style: every field names its type (none is ``object``), and nothing is attached after
    construction (the dataclasses are frozen)."""
    hints = typing.get_type_hints(cls)
    assert hints and not [name for name, hint in hints.items() if _names_object(hint)], hints
    assert not {"start", "stop"} & set(hints)  # no closures: the loader opens and closes
    if dataclasses.is_dataclass(cls):
        assert cls.__dataclass_params__.frozen, cls


def test_stage_data_is_complete_at_construction(tmp_path):
    """No ``StageData`` without its loader, and none of its fields is set afterwards; a
    pretraining loader holds nothing but what it declares, before and after reading."""
    with pytest.raises(TypeError, match="loader"):
        StageData(total_steps=1)
    data = StageData(loader=PretrainLoader(_recipe(tmp_path, 6)), total_steps=6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.loader = None
    declared = set(typing.get_type_hints(PretrainLoader))
    assert set(vars(data.loader)) <= declared
    data.loader.open(0)
    data.loader.close()
    assert set(vars(data.loader)) <= declared
