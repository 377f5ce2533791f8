"""Held-out loss (docs/contracts.md §8): the exact per-token mean over the set, weighted by supervised tokens."""
import math

import pytest
import torch
import torch.nn.functional as F

from ds_trhash.eval.heldout import heldout_loss
from ds_trhash.model.loss import IGNORE_INDEX as IGNORE
from ds_trhash.model import TRHashConfig, TRHashForCausalLM

VOCAB, T = 64, 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TRHashForCausalLM(TRHashConfig.from_preset("tiny", vocab_size=VOCAB, num_layers=2, max_seq_len=32))


def _batch(rows, supervised, seed):
    """[rows, T] batch whose row r has supervised[r] labelled positions (the rest -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (rows, T), generator=g)
    labels = torch.full((rows, T), IGNORE, dtype=torch.long)
    for r, n in enumerate(supervised):
        labels[r, T - n:] = torch.randint(4, VOCAB, (n,), generator=g)
    pos = torch.arange(T).expand(rows, T).clone()
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": torch.zeros(rows, T, dtype=torch.long)}


class Counting(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@torch.no_grad()
def _token_losses(model, batch):
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    losses = F.cross_entropy(logits.reshape(-1, VOCAB).double(), batch["labels"].reshape(-1),
                             ignore_index=IGNORE, reduction="none")
    return losses[batch["labels"].reshape(-1) != IGNORE]


def test_token_weighted_mean_not_mean_of_batch_means(model):
    batches = [_batch(2, [1, 0], 1), _batch(2, [T, T], 2), _batch(2, [3, 5], 3)]
    per_batch = [_token_losses(model, b) for b in batches]
    assert [len(x) for x in per_batch] == [1, 2 * T, 8]
    expected = float(torch.cat(per_batch).sum()) / sum(len(x) for x in per_batch)
    batch_means = sum(float(x.mean()) for x in per_batch) / len(per_batch)
    assert abs(expected - batch_means) > 1e-3  # the two rules differ on this data

    got = heldout_loss(model, [dict(b) for b in batches], torch.device("cpu"))
    assert got["eval_tokens"] == 1 + 2 * T + 8
    assert got["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert got["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_all_padding_batches_run_but_contribute_nothing(model):
    real = [_batch(2, [4, 2], 5), _batch(1, [7], 6)]
    padding = _batch(2, [0, 0], 7)
    counted = Counting(model)
    base = heldout_loss(counted, [dict(b) for b in real], torch.device("cpu"))
    assert counted.calls == 2
    counted.calls = 0
    with_padding = heldout_loss(counted, [dict(padding), dict(real[0]), dict(padding), dict(real[1])], torch.device("cpu"))
    assert counted.calls == 4  # every batch runs a forward (expert-parallel peers must not wait)
    assert with_padding == pytest.approx(base)


def test_no_supervised_tokens_raises(model):
    with pytest.raises(ValueError, match="no supervised tokens"):
        heldout_loss(model, [_batch(2, [0, 0], 8)], torch.device("cpu"))


def test_training_mode_is_restored(model):
    model.train()
    try:
        heldout_loss(model, [_batch(1, [3], 9)], torch.device("cpu"))
        assert model.training
    finally:
        model.eval()
