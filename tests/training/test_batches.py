"""Packed SFT batches as the loop sees them, and the proof that per-document packing isolates
examples: no token of one example can change another example's logits."""

import numpy as np
import pytest
import torch
from tests.data.sft_fixtures import VOCAB_SIZE, conversation, write_jsonl

from ds_trhash.data.sft.build import build_sft_dataset
from ds_trhash.data.sft.dataset import SFTBatches, open_sft, pack
from ds_trhash.model import TRHashConfig, TRHashForCausalLM
from ds_trhash.data.stream.reader import ReplayReader
from ds_trhash.data.stream.opening import open_corpus
from ds_trhash.training.batches import PretrainBatches, SFTStepBatches, data_wait_line
from tests.data.hub_corpus import REPO, hub_corpus  # noqa: F401  (the fixture)

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


def test_data_wait_line_reports_the_share_of_step_time_spent_reading_and_waiting_for_shards(hub_corpus, tmp_path):
    """The stage-end line: seconds reading batches against step seconds, and of those the seconds
    waiting for downloads through the node cache (counts from the cache itself)."""
    hub, _, doc = hub_corpus
    corpus = open_corpus(doc, f"hf://datasets/{REPO}")
    with corpus.open_cache(tmp_path / "cache", 2**30, prefetch=0) as cache:
        batches = PretrainBatches(ReplayReader(doc, None, 0, cache=cache), micro_batch=2, grad_accum=2, rank=0,
                                  world_size=1)
        batches.micro_batches(0)
        line = data_wait_line(batches, 10.0, 1)
        stats = cache.stats()
    assert batches.data_s > 0 and line.startswith(f"data wait on rank 0: {batches.data_s:.3f} s of 10.000 s in 1 step(s)")
    waited = float(line.split("; ")[1].split(" s of it")[0])
    assert 0 < waited <= batches.data_s and stats["misses"] >= 1, line
    assert f"{stats['misses']} fetched on demand, 0 prefetched, {stats['hits']} cache hits)" in line, line
    assert data_wait_line(SFTStepBatches(None, 1, "cross_document"), 10.0, 1) is None  # not read from shards
