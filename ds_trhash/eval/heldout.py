"""Held-out loss over a finite evaluation set, all ranks, weighted by supervised tokens.

Each rank scores its own share of the evaluation windows; the summed token losses and token
counts are added over ranks, so the result is the exact per-token mean over the whole set
(not a mean of per-rank or per-batch means) and does not depend on the world size.
"""

from __future__ import annotations

import math
from typing import Iterable, Protocol

import torch
import torch.distributed as dist

from ds_trhash.model.loss import IGNORE_INDEX
from ds_trhash.ranks import is_multi_rank


class Scored(Protocol):
    """A model, or the DeepSpeed engine around one: called as the loss, switched to eval and back."""

    training: bool

    def __call__(self, *inputs: object, **kwargs: object) -> torch.Tensor: ...

    def eval(self) -> object: ...

    def train(self, mode: bool = True) -> object: ...


@torch.no_grad()
def heldout_loss(model: Scored, batches: Iterable[dict[str, torch.Tensor]], device: torch.device) -> dict:
    """``model(input_ids, labels=..., reduction="sum", **extra)`` over this rank's batches."""
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    tokens = 0
    for b in batches:
        # Every rank runs every forward, even one with nothing supervised (an all-padding filler
        # window): expert-parallel layers exchange tokens inside the forward, so a rank that
        # skipped one would leave its peers waiting.
        b = {k: v.to(device) for k, v in b.items()}
        n = int((b["labels"] != IGNORE_INDEX).sum())
        batch_loss = model(b.pop("input_ids"), labels=b.pop("labels"), reduction="sum", **b)
        loss_sum += float(batch_loss) if n else 0.0
        tokens += n
    t = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=device)
    if is_multi_rank():
        dist.all_reduce(t)
    if was_training:
        model.train()
    total_loss, total_tokens = t.tolist()
    if total_tokens == 0:
        raise ValueError("the held-out set has no supervised tokens; check the eval partition")
    loss = total_loss / total_tokens
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(total_tokens)}
