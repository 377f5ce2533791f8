"""The stage's data loader: one declared interface that the loop, the trainer and the callbacks
rely on, and its two implementations.

Micro-batches are a pure function of the optimizer step, so an exact resume needs only the step
number (and the saved ``cursor`` says where in the data that step starts). ``PretrainLoader``
streams replay-plan rows through the node's shard cache (``data.stream``); it is built complete
from a :class:`StreamRecipe` before any model exists, reads nothing until ``open`` (once every
launch check passed) and releases its thread and cache in ``close`` (the trainer's ``finally``).
``SFTLoader`` serves packed SFT windows held in memory: nothing to open or close.
"""

from __future__ import annotations

import abc
import datetime
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.plans.plan import PlanLike
from ds_trhash.data.sft.dataset import SFTBatches
from ds_trhash.data.stream.cache import claim
from ds_trhash.data.stream.corpus import Corpus
from ds_trhash.data.stream.delivery import CHUNK_ROWS, DataFigures, NodeShare, RankStream, Readiness, open_stream

MicroBatches = list[dict[str, torch.Tensor]]  # one optimizer step of this rank, in micro-step order


class DataLoader(abc.ABC):
    """What a stage trains on, as the loop, the trainer and the callbacks use it."""

    @abc.abstractmethod
    def micro_batches(self, step: int) -> MicroBatches:
        """This rank's micro-batches of optimizer step ``step``."""

    @abc.abstractmethod
    def epoch_of(self, step: int) -> int:
        """The epoch optimizer step ``step`` belongs to (0 for a one-pass stream)."""

    @abc.abstractmethod
    def cursor(self, step: int) -> int:
        """Where in the data step ``step`` starts: the data cursor every checkpoint records."""

    @property
    @abc.abstractmethod
    def steps_per_epoch(self) -> int | None:
        """Optimizer steps per epoch; None for a one-pass pretraining stream."""

    def open(self, first_step: int) -> None:
        """Start reading at ``first_step`` (the saved step on a resume): called once, after every
        launch check passed and before the model is built. Nothing to open by default."""

    def close(self) -> None:
        """Release what ``open`` started; safe before ``open`` and twice. Nothing by default."""

    def figures(self) -> DataFigures | None:
        """The stream's reading figures (waits, cache counts, downloads); None when nothing streams."""
        return None

    def readiness(self, step: int) -> Readiness:
        """Before ``step``, for the stop agreement: (this rank still reads its part, the status of a
        failed read, who failed + 1: its node in a row exchange, else its rank). Ready by default."""
        return (0, 0, 0)

    def wait_read(self, step: int, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for this rank's read of ``step``, which ``readiness``
        said is still running (the agreement asks again after); by default, the whole time."""
        time.sleep(timeout)

    def agreed(self, step: int, status: int, node: int) -> None:
        """What the stop agreement found before ``step``; nothing to do by default."""


@dataclass(frozen=True)
class StreamRecipe:
    """What opening a pretraining stream needs, decided before the model exists."""

    corpus: Corpus  # the store, its pinned commit and every planned shard (``data.stream.corpus``)
    plan: PlanLike
    seed: int
    layout: BatchLayout  # this rank's cut of the global batch
    cache_dir: Path  # the node's shard cache, created by ``open``
    max_bytes: int  # the cache bound
    ranks_on_node: int
    end: int  # the step the stage stops before
    prefetch_s: float  # how far ahead the plan's shards are fetched
    budget_s: float | None = None  # one read's budget (data.hub_wait_minutes); None: none
    nodes: int = 1  # the nodes that exchange rows (1: each node reads its own part)
    chunk_rows: int = CHUNK_ROWS  # global rows per exchange (data.exchange_rows)
    pin_memory: bool = False  # batches assembled in pinned memory (CUDA)


def node_share(rank: int, world: int, per_node: int, wait_s: float | None, chunk_rows: int) -> NodeShare:
    """This rank's part in the exchange between ``world // per_node`` nodes. Every rank creates
    every node's exchange group (the ranks with one local index), in the same order, as
    ``new_group`` requires; each carries nothing but its exchanges (a member's part may be sent
    steps after the others'). A member's exchange waits, in the background, for a node whose read
    waits out an outage within its budget (``wait_s``, one read's): the groups' timeout is that
    budget and ten minutes more (without a budget: the default group timeout)."""
    timeout = datetime.timedelta(seconds=wait_s + 600) if wait_s is not None else None
    groups = [dist.new_group(list(range(local, world, per_node)), backend="gloo", timeout=timeout)
              for local in range(per_node)]
    return NodeShare(rank // per_node, world // per_node, groups[rank % per_node], chunk_rows, budget_s=wait_s)


class PretrainLoader(DataLoader):
    """Replay-plan rows: step s covers global rows [s·G, (s+1)·G) whatever the world size. The
    stream (data layer) assembles them and owns the reading's lifetime, from ``open`` to ``close``."""

    recipe: StreamRecipe
    _stream: RankStream | None

    def __init__(self, recipe: StreamRecipe) -> None:
        self.recipe = recipe
        self._stream = None

    @property
    def stream(self) -> RankStream | None:
        """The open stream (None before ``open``; kept, closed, after ``close``)."""
        return self._stream

    def _reading(self) -> RankStream:
        if self._stream is None:
            raise RuntimeError("the pretraining data loader is not open: call open(first_step) before asking "
                               "for batches (the trainer opens it once every launch check passed)")
        return self._stream

    @property
    def steps_per_epoch(self) -> None:
        return None

    def open(self, first_step: int) -> None:
        # One cache per node: every rank of this node opens the same folder; each shard is
        # downloaded once and verified (size and SHA-256) before any rank reads it. The next
        # steps' batches are assembled in the background, in pinned memory on CUDA, from the
        # first step on at once: its shards are fetched while the model and engine are built.
        if self._stream is not None:
            raise RuntimeError("the pretraining data loader is already open")
        r, layout = self.recipe, self.recipe.layout
        share = (node_share(layout.rank, layout.world_size, r.ranks_on_node, r.budget_s, r.chunk_rows)
                 if r.nodes > 1 else None)
        self._stream = open_stream(r.corpus, r.plan, r.seed, layout, claim(r.cache_dir), r.max_bytes,
                                   r.ranks_on_node, pin_memory=r.pin_memory, end=r.end, prefetch_s=r.prefetch_s,
                                   first_step=first_step, share=share, budget_s=r.budget_s)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()  # itself safe to call twice

    def micro_batches(self, step: int) -> MicroBatches:
        return [{"input_ids": inputs, "labels": labels} for inputs, labels in self._reading().micro_batches(step)]

    def epoch_of(self, step: int) -> int:
        return 0

    def cursor(self, step: int) -> int:
        """The global row index the next step starts at (saved in checkpoints)."""
        return step * self.recipe.layout.global_batch

    def figures(self) -> DataFigures | None:
        return self._stream.figures() if self._stream is not None else None

    def readiness(self, step: int) -> Readiness:
        """Before ``step``: whether this rank's data is still being read (the stop agreement asks)."""
        return self._reading().readiness(step)

    def wait_read(self, step: int, timeout: float) -> None:
        self._reading().wait_read(step, timeout)

    def agreed(self, step: int, status: int, node: int) -> None:
        self._reading().agreed(step, status, node)


@dataclass(frozen=True)
class SFTLoader(DataLoader):
    """Packed SFT windows; epoch e's order is a pure function of (seed, e)."""

    batches: SFTBatches
    grad_accum: int
    policy: str  # cross_document | per_document

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.batches_per_epoch // self.grad_accum

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def micro_batches(self, step: int) -> MicroBatches:
        epoch, within = divmod(step, self.steps_per_epoch)
        out = []
        for m in range(self.grad_accum):
            b = dict(self.batches.batch(epoch, within * self.grad_accum + m))
            if self.policy != "per_document":
                # Release behaviour: positions run over the whole window, attention crosses examples.
                b.pop("document_ids", None)
                b.pop("position_ids", None)
            out.append(b)
        return out

    def cursor(self, step: int) -> int:
        return step * self.grad_accum
