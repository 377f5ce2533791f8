"""One rank's stream of micro-batches, step after step: what a training step reads.

``RankStream`` cuts each step's micro-batches from the plan's reader (``reader``), one step or two
ahead of the step being trained, on a background thread (``assembly``), in pinned host memory
when the launch trains on CUDA. On several nodes reading the Hub it takes them instead from the
row exchange (``exchange``): each node reads the shards it owns, for every node. Either way it
answers the stop agreement before each step (``readiness``, ``agreed``, ``wait_read``): whether
this rank still reads the step, whether its read failed, and, once every rank answered, another
rank's failure, which it raises at that step as every other rank does. It owns what
the reading holds: ``close`` (or leaving its ``with`` block) stops the thread, closes the node
cache and releases every shard, and the launch calls it in a ``finally``. ``figures()`` is the one read-only view of what the reading cost
(``DataFigures``): counters only, no file walked, cheap enough to ask at every step.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.stream.delivery.assembly import Ahead
from ds_trhash.data.stream.deadline import read_deadline
from ds_trhash.data.stream.delivery.exchange import OK, CHUNK_ROWS, Readiness, RowExchange, rank_read_error, status_of
from ds_trhash.data.stream.delivery.reader import DEFAULT_PREFETCH_S, ReplayReader
from ds_trhash.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), each int64 [micro_batch, seq_len]
DEFAULT_AHEAD = 2

if TYPE_CHECKING:  # type names only: the corpus room opens the cache a stream reads through
    from ds_trhash.data.plans.plan import PlanLike
    from ds_trhash.data.stream.corpus import Corpus


@dataclass(frozen=True)
class NodeShare:
    """This rank's place among the nodes of a job that exchanges rows (``exchange``): its node,
    the node count, the gloo group of the ranks with its local index (None: the default group),
    the global rows of one exchange, and one read's budget (``data.hub_wait_minutes``)."""
    node: int
    nodes: int
    group: Optional[dist.ProcessGroup] = None
    chunk_rows: int = CHUNK_ROWS
    budget_s: Optional[float] = None


@dataclass(frozen=True)
class DataFigures:
    """What this process's reading cost so far. The training thread waited ``queue_wait_s`` (a part
    of its step time) for steps that were not yet assembled; assembling them took ``read_s``
    (cutting rows into tensors) plus ``shard_wait_s`` (bringing shards into the working set:
    checks, holds, downloads waited for), two parts of ``assembly_s``. Cache figures are this
    process's counts (``downloaded_bytes``: the bytes of the shards it downloaded and verified, on
    demand or prefetched); ``cache_bytes`` / ``cache_files`` are the node's usage as its last scan
    saw it (None before any, or without a cache)."""
    rank: int
    steps: int
    background: bool
    queue_wait_s: float
    read_s: float
    shard_wait_s: float
    cached: bool = False
    fetched: int = 0  # shards downloaded because a read needed them
    prefetched: int = 0
    hits: int = 0  # shards found verified in the cache as they entered the working set
    evictions: int = 0
    downloaded_bytes: int = 0
    cache_bytes: Optional[int] = None
    cache_files: Optional[int] = None
    max_bytes: Optional[int] = None

    @property
    def assembly_s(self) -> float:
        return self.read_s + self.shard_wait_s


class RankStream:
    def __init__(self, reader: ReplayReader, layout: BatchLayout, ahead: int = DEFAULT_AHEAD,
                 pin_memory: bool = False, end: Optional[int] = None, share: Optional[NodeShare] = None,
                 budget_s: Optional[float] = None) -> None:
        """``ahead``: steps assembled in the background (0: on the caller's thread, as it asks);
        ``end``: the step the stage stops before (nothing is assembled ahead from there);
        ``share``: rows exchanged between nodes (``exchange``), which reads in the background itself;
        ``budget_s``: one step's read, every wait in it included (``deadline``; None: none)."""
        self.reader, self.layout, self.pin_memory, self.budget_s = reader, layout, pin_memory, budget_s
        # the device pinned copies are made for: the assembly thread's own current device is
        # device 0 until it is set (one CUDA context per rank on GPU 0), as DataLoader's pin thread knows
        self._device: Optional[int] = torch.cuda.current_device() if pin_memory else None
        self._ahead: Optional[Ahead | RowExchange] = None
        if share is not None:
            self._ahead = RowExchange(reader, layout, share.node, share.nodes, share.group, end, share.chunk_rows,
                                      finish=self._pinned, budget_s=share.budget_s)
        elif ahead > 0:
            self._ahead = Ahead(self._assemble, ahead, end)
        self._lock = threading.Lock()
        self._peer_failed: dict[int, tuple[int, int]] = {}  # step: (rank, status) of another rank's failed read
        self._assembly_s = self._shard_s = self._sync_wait_s = 0.0
        self._steps = 0
        self.closed = False

    def _assemble(self, step: int) -> list[Batch]:
        started = time.perf_counter()
        if self._device is not None:
            torch.cuda.set_device(self._device)
        layout, out = self.layout, []
        with read_deadline(self.budget_s):  # the step's waits for shards end within one budget
            for micro in range(layout.grad_accum):
                inputs, labels = self.reader.batch(step, micro, layout)
                if self.pin_memory:  # the copy to the device then runs asynchronously
                    inputs, labels = inputs.pin_memory(), labels.pin_memory()
                out.append((inputs, labels))
        with self._lock:  # both at once: the figures always add up
            self._assembly_s += time.perf_counter() - started
            self._shard_s = self.reader.shard_wait_s
        return out

    def _pinned(self, inputs: torch.Tensor, labels: torch.Tensor) -> Batch:
        if self.pin_memory:
            return inputs.pin_memory(), labels.pin_memory()
        return inputs, labels

    def begin(self, step: int) -> None:
        """Start assembling the stage's first step now, in the background (nothing without
        background assembly): the shards it reads are fetched while the model is built."""
        if self._ahead is not None:
            self._ahead.start(step)

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of optimizer step ``step``, in micro-step order."""
        if self.closed:
            raise RuntimeError("batches asked of a closed RankStream")
        if isinstance(self._ahead, Ahead):
            batches = self._ahead_batches(step)
        elif self._ahead is not None:
            batches = self._ahead.get(step)
        else:
            started = time.perf_counter()
            batches = self._assemble(step)
            self._sync_wait_s += time.perf_counter() - started
        self._steps += 1
        return batches

    def _ahead_batches(self, step: int) -> list[Batch]:
        """The step the background assembly made; at a step where another rank's read failed
        (the agreement said so: ``agreed``), an error naming that rank, as every rank raises one
        there; this rank's own failed read, marked as its own to print (``UserError.per_rank``)."""
        ahead = self._ahead
        if not isinstance(ahead, Ahead):  # called for the background assembly only
            raise RuntimeError("no background assembly to take a step from")
        failed = self._peer_failed.pop(step, None)
        _, error = ahead.pending(step)
        if failed is not None and error is None:
            raise rank_read_error(failed[0], failed[1], step)
        try:
            return ahead.get(step)
        except UserError as e:
            e.per_rank = self.layout.world_size > 1  # one line from each rank that met it (its peers name it)
            raise

    def readiness(self, step: int) -> Readiness:
        """Before ``step``, for the stop agreement: (1 while this rank still reads its part of the
        step, the status of a failed read, then its node + 1 (an exchange: ``RowExchange.readiness``)
        or its rank + 1 (each rank reads its own rows in the background)). Nothing to wait for
        when the step is read on the training thread."""
        if isinstance(self._ahead, RowExchange):
            return self._ahead.readiness(step)
        if isinstance(self._ahead, Ahead):
            pending, error = self._ahead.pending(step)
            if pending:
                return 1, OK, 0
            if error is not None:
                return 0, status_of(error), self.layout.rank + 1
        return 0, OK, 0

    def wait_read(self, step: int, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for this rank's read of ``step`` (the agreement asks
        again then): returns as soon as the background assembly finished it."""
        if isinstance(self._ahead, Ahead):
            self._ahead.wait(step, timeout)
        else:
            time.sleep(timeout)

    def agreed(self, step: int, status: int, who: int) -> None:
        """What the agreement found before ``step``: a failed read of node ``who`` - 1 (an
        exchange: ``RowExchange.agreed``) or of rank ``who`` - 1, raised at ``step``."""
        if isinstance(self._ahead, RowExchange):
            self._ahead.agreed(step, status, who)
        elif status != OK and who > 0:
            self._peer_failed[step] = (who - 1, status)

    def figures(self) -> DataFigures:
        with self._lock:
            assembly, shard = self._assembly_s, self._shard_s
        if isinstance(self._ahead, RowExchange):
            assembly, shard = self._ahead.assembly_s, self.reader.shard_wait_s
        waited = self._ahead.wait_s if self._ahead is not None else self._sync_wait_s
        figures = DataFigures(rank=self.layout.rank, steps=self._steps, background=self._ahead is not None,
                              queue_wait_s=waited, read_s=max(0.0, assembly - shard), shard_wait_s=shard)
        cache = self.reader.cache
        if cache is None:
            return figures
        c = cache.counters()
        return dataclasses.replace(figures, cached=True, fetched=c["misses"], prefetched=c["prefetched"], hits=c["hits"],
                                   evictions=c["evictions"], downloaded_bytes=int(c["downloaded_bytes"]),
                                   cache_bytes=c["bytes"], cache_files=c["files"], max_bytes=c["max_bytes"])

    def close(self) -> None:
        """Stop the background thread, close the cache (its prefetcher joined, a wait for room cut
        short), release every shard. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._ahead is not None:
                self._ahead.request_stop()
            if self.reader.cache is not None:
                self.reader.cache.close()
            if self._ahead is not None:
                self._ahead.close()
        finally:
            if self._ahead is None or not self._ahead.running:  # never under a thread still reading
                self.reader.close()

    def __enter__(self) -> "RankStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_stream(corpus: Corpus, plan: PlanLike, seed: int, layout: BatchLayout, cache_dir: os.PathLike | str, max_bytes: int, ranks_on_node: int,
                ahead: int = DEFAULT_AHEAD, pin_memory: bool = False, end: Optional[int] = None,
                prefetch_s: float = DEFAULT_PREFETCH_S, first_step: Optional[int] = None,
                share: Optional[NodeShare] = None, budget_s: Optional[float] = None) -> RankStream:
    """This rank's stream of ``plan`` through the node's cache of ``corpus`` (``corpus.Corpus``),
    prefetching what the plan reads in the next ``prefetch_s`` seconds, and assembling
    ``first_step`` from now on when given; ``share``: rows exchanged between nodes; ``budget_s``:
    one step's read (``data.hub_wait_minutes``); a failure after the cache opened closes it again."""
    cache = corpus.open_cache(cache_dir, max_bytes, ranks_on_node=ranks_on_node, fetch_process=True)
    try:
        reader = ReplayReader(plan, None, seed, cache=cache, prefetch_s=prefetch_s)
        stream = RankStream(reader, layout, ahead=ahead, pin_memory=pin_memory, end=end, share=share,
                            budget_s=budget_s)
    except BaseException:
        cache.close()
        raise
    if first_step is not None:
        stream.begin(first_step)
    return stream
