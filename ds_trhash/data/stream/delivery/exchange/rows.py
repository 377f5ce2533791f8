"""Rows across nodes: each shard filled by one node, the rows the others train on sent to them.

On several nodes reading a Hub store, every shard has one **owner** node (``owners``: a pure
function of the plan and the node count) and only the owner's cache ever fills it, so each shard
leaves the Hub once per job and each node downloads, verifies and stores 1/N of the corpus. The
rows every rank trains on stay those of the one global order (``reader``): bit for bit the same
windows, in the same order, as a rank reading every shard itself.

The rows travel by **chunks** of steps (about ``CHUNK_ROWS`` global rows: one shuffle window) in
the ranks' *exchange group*: the ranks that share this rank's local index, one per node, over gloo
(CPU tensors, a group that carries nothing else). For chunk c:

1. a background thread (``_prepare``) computes from the plan alone which rows each member of the
   group trains on in the chunk, reads those in this node's shards from the node cache (one read,
   ``ReplayReader.read_rows``, all its waits within one deadline: ``data.hub_wait_minutes``) and
   prefetches this node's shards of the next chunk and horizon;
2. the training thread sends them with one asynchronous ``all_to_all_single`` (each member's
   part: an 8-byte status, then its rows as stored, uint16) at the first step of chunk c - 1, or
   at the first later step at which its read is done: it never waits for a read in the middle of
   a chunk (the members' sends match by their order in the group, not by step);
3. at the first step of chunk c it waits for that exchange and cuts its micro-batches from its
   rows, put back in their places.

Waits across ranks. A read still running at its chunk's first step would hold its rank outside
the step's collectives while every other rank waits inside them. So before a chunk's first step
every rank of the job answers ``readiness`` in the stop agreement (``training.callbacks.stop``),
which asks again, every fraction of a second, until every rank has sent its part or a stop is
agreed: no rank waits in a collective of the default group for a read, and a stop during the
wait is the agreed stop. A read that outlives its deadline is sent as a failure.

A rank whose read failed (a Hub that stayed away, a corrupt shard) still takes part, sending a
status instead of rows, and the agreement carries its status to every rank: at the chunk's first
step every rank of the job raises, the failing rank its own error, the others one naming that
node (``PeerReadError``, a ``StoreUnavailable`` when that was the cause, so each rank's launch
says how to relaunch). A rank that closes sends what it still owes with a "stopped" status, so
that no member's exchange is left unmatched and close never waits for a read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable, Optional, cast

import numpy as np
import torch
import torch.distributed as dist

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.formats.shards import TOKEN_DTYPE
from ds_trhash.data.stream.deadline import read_deadline
from ds_trhash.data.stream.delivery.exchange.chunk import HEADER, OK, STOPPED, Chunk, peer_error, status_of
from ds_trhash.data.stream.delivery.exchange.nodes import owners
from ds_trhash.data.stream.order import RowRef
from ds_trhash.data.stream.delivery.reader import ReaderError, ReplayReader
from ds_trhash.data.stream.store import ReadTimedOut
from ds_trhash.data.stream.types import Key
from ds_trhash.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]
Readiness = tuple[int, int, int]  # (this rank still reads its part: 1, the status it sent, its node + 1 when failed)
CHUNK_ROWS = 4096  # global rows per exchange (rounded down to whole steps, at least one)
THREAD_NAME = "row-exchange"
CLOSE_WAIT_S = 10.0  # how long close waits for the exchanges in flight (every member sent its part: at once)
JOIN_S = 2.0  # how long close waits for the read thread (a daemon: a download in it is not waited out)


def _wait(chunk: Chunk, timeout: Optional[datetime.timedelta] = None) -> None:
    """Wait for ``chunk``'s exchange, issued before it was queued (every queued chunk has one)."""
    if chunk.work is None:
        raise RuntimeError("a chunk was waited for before its exchange was issued")
    if timeout is None:
        chunk.work.wait()
    else:
        chunk.work.wait(timeout)


class RowExchange:
    """This rank's micro-batches, chunk by chunk, from rows read by their shards' owners (see the
    module). The interface of ``assembly.Ahead`` (``get``, ``start``, ``request_stop``,
    ``close``), and ``readiness`` / ``agreed`` for the stop agreement.

    ``group``: the gloo group of the ranks with this rank's local index, one per node in node
    order, carrying nothing but these exchanges (None: the default group, for a caller that
    issues nothing else on it); ``node`` / ``nodes``: this rank's node and the node count;
    ``end``: the step the stage stops before; ``budget_s``: one read's budget (None: none)."""

    def __init__(self, reader: ReplayReader, layout: BatchLayout, node: int, nodes: int,
                 group: Optional[dist.ProcessGroup] = None,
                 end: Optional[int] = None, chunk_rows: int = CHUNK_ROWS,
                 finish: Optional[Callable[[torch.Tensor, torch.Tensor], Batch]] = None,
                 budget_s: Optional[float] = None) -> None:
        if layout.world_size % nodes or not 0 <= node < nodes:
            raise ReaderError(f"world size {layout.world_size} is not {nodes} nodes of equal rank counts (node {node})")
        self.reader, self.layout, self.node, self.nodes, self.group = reader, layout, node, nodes, group
        per_node = layout.world_size // nodes
        self.members = [m * per_node + layout.rank % per_node for m in range(nodes)]  # the group, in node order
        self.global_batch = layout.global_batch
        self.chunk_steps = max(1, chunk_rows // self.global_batch)
        self.plan_steps = reader.num_rows // self.global_batch
        self.end = self.plan_steps if end is None else min(int(end), self.plan_steps)
        self.owner = owners(reader, nodes)
        self.budget_s = budget_s
        self._finish = finish or (lambda inputs, labels: (inputs, labels))
        self._row_bytes = (reader.seq_len + 1) * TOKEN_DTYPE.itemsize
        # the reader's one thread: a daemon, so that a read stuck in a download never holds up the
        # process's exit (an executor's threads are joined at exit)
        self._todo: queue.SimpleQueue[Optional[tuple[int, Future]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()
        self._prepared: dict[int, Future] = {}
        self._began: dict[int, float] = {}  # when each read began (its deadline runs from there)
        self._refs: dict[int, list[RowRef]] = {}  # under _plan_lock, with the reader's order
        self._plan_lock = threading.Lock()
        self._owed: list[int] = []  # chunks every member sends now, this rank's part not sent yet (a read)
        self._issued: dict[int, Chunk] = {}
        self._agreed: dict[int, tuple[int, int]] = {}  # chunk: (node, status) of another rank's failed read
        self._batches: tuple[int, list[list[Batch]]] = (-1, [])  # (chunk, its steps' micro-batches)
        self.wait_s = self.assembly_s = 0.0
        self.sent_bytes = 0  # rows' bytes sent to other nodes (the figures, the benchmark)
        self.closed = False

    # -- which rows ----------------------------------------------------------------------
    def _steps(self, chunk: int) -> range:
        first = chunk * self.chunk_steps
        return range(first, min(first + self.chunk_steps, self.plan_steps))

    def _positions(self, rank: int, steps: range) -> np.ndarray:
        """Positions in the chunk's rows of ``rank``'s rows, in the order it trains on them (step,
        micro-step, row; ``BatchLayout.first_row``)."""
        first, layout = steps.start * self.global_batch, dataclasses.replace(self.layout, rank=rank)
        starts = np.array([layout.first_row(step, micro)
                           for step in steps for micro in range(layout.grad_accum)]) - first  # [steps · ga]
        return (starts[:, None] + np.arange(layout.micro_batch)[None, :]).reshape(-1)

    def _keys_owned(self, refs: list[RowRef]) -> tuple[Key, ...]:
        return tuple(key for key in dict.fromkeys((s, f) for s, f, _ in refs) if self.owner[key] == self.node)

    def _rows(self, chunk: int) -> list[RowRef]:
        """The chunk's global rows (the last two chunks' remembered: each is asked for once to
        prefetch, once to read)."""
        if chunk not in self._refs:
            steps = self._steps(chunk)
            self._refs = {c: r for c, r in self._refs.items() if c == chunk - 1}
            self._refs[chunk] = self.reader.global_rows(steps.start * self.global_batch, len(steps) * self.global_batch)
        return self._refs[chunk]

    # -- background: this node's rows for every member ----------------------------------
    def _layout(self, chunk: int) -> Chunk:
        """Who sends which rows to whom in chunk ``chunk``: the plan's arithmetic alone, the same
        on every member."""
        steps, refs = self._steps(chunk), self._rows(chunk)
        owner = np.fromiter((self.owner[(s, f)] for s, f, _ in refs), dtype=np.int64, count=len(refs))
        sends = [wanted[owner[wanted] == self.node] for wanted in (self._positions(m, steps) for m in self.members)]
        mine = owner[self._positions(self.layout.rank, steps)]
        places = [np.nonzero(mine == node)[0] for node in range(self.nodes)]
        return Chunk(refs, sends, [HEADER + len(part) * self._row_bytes for part in sends],
                     [HEADER + len(place) * self._row_bytes for place in places], places, len(mine))

    def _next_keys(self, chunk: int) -> tuple[tuple[Key, ...], tuple[Key, ...]]:
        """This node's shards of the chunk after ``chunk``, and of the horizon after it."""
        following = self._steps(chunk + 1)
        if not len(following):
            return (), ()
        horizon = self.reader.horizon_keys(following.start * self.global_batch)
        return self._keys_owned(self._rows(chunk + 1)), tuple(key for key in horizon if self.owner[key] == self.node)

    def _prepare(self, chunk: int) -> Chunk:
        """The rows this node owns for every member, read in one go (every wait of the read
        within one budget); this node's shards of the next chunk and of the horizon named to
        the cache. A failed read is sent as its status."""
        started = time.perf_counter()
        with self._plan_lock:
            found = self._layout(chunk)
            upcoming, ahead = self._next_keys(chunk)
        try:
            with read_deadline(self.budget_s):
                found.pack(self.reader.read_rows([found.refs[i] for i in np.concatenate(found.sends)], upcoming, ahead))
        except Exception as exc:  # told to every member at the chunk's exchange, raised there
            found.fail(exc)
        self.assembly_s += time.perf_counter() - started
        return found

    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            chunk, future = item
            if future.set_running_or_notify_cancel():
                self._began[chunk] = time.monotonic()
                try:
                    future.set_result(self._prepare(chunk))
                except BaseException as exc:  # a failure of the plan's arithmetic: the same on every member
                    future.set_exception(exc)

    # -- training thread: the collectives, in step order ---------------------------------
    def _submit(self, chunk: int) -> None:
        if chunk not in self._prepared:
            self._prepared[chunk] = Future()
            self._todo.put((chunk, self._prepared[chunk]))

    def _prepare_soon(self, chunk: int) -> None:
        """Read chunk ``chunk``'s rows in the background, if the stage reaches it."""
        if chunk * self.chunk_steps < self.end:
            self._submit(chunk)

    def _owe(self, chunk: int) -> None:
        """Chunk ``chunk``'s exchange is due: every member sends its part from now on."""
        self._submit(chunk)
        self._owed.append(chunk)

    def _found(self, chunk: int, block: bool) -> Optional[Chunk]:
        """Chunk ``chunk``'s rows read, or its failure once the read outlived its budget; None
        while it reads (``block``: waited for, within that budget)."""
        now = time.monotonic()
        left = None if self.budget_s is None else self._began.get(chunk, now) + self.budget_s - now
        try:
            found = self._prepared[chunk].result(timeout=(None if left is None else max(0.0, left)) if block else 0.0)
        except FutureTimeout:
            if left is None or (not block and left > 0):
                return None
            found, steps = self._failed(chunk), self._steps(chunk)
            found.fail(ReadTimedOut(f"node {self.node} did not read the rows it owns for steps {steps.start}-"
                                    f"{steps.stop - 1} within data.hub_wait_minutes ({self.budget_s:g} s)"))
        self._prepared.pop(chunk)
        self._began.pop(chunk, None)
        return found

    def _failed(self, chunk: int) -> Chunk:
        """Chunk ``chunk``'s layout for a status without rows (the plan's arithmetic is the
        read thread's too: taken in turn)."""
        with self._plan_lock:
            return self._layout(chunk)

    def _issue_owed(self, through: int = -1) -> None:
        """Send the parts owed whose reads are done, in chunk order (those up to ``through``
        waited for, each within its read's budget)."""
        while self._owed:
            chunk = self._owed[0]
            found = self._found(chunk, block=chunk <= through)
            if found is None:
                return
            self._owed.pop(0)
            self._send(chunk, found)

    def _send(self, chunk: int, found: Chunk) -> None:
        found.recv = torch.empty(sum(found.recv_bytes), dtype=torch.uint8)
        found.work = dist.all_to_all_single(found.recv, torch.from_numpy(found.send), found.recv_bytes,
                                            found.send_bytes, group=self.group, async_op=True)
        self.sent_bytes += sum(found.send_bytes) - found.send_bytes[self.node] - HEADER * (self.nodes - 1)
        self._issued[chunk] = found

    def _unpack(self, chunk: int, found: Chunk) -> np.ndarray:
        """This rank's rows of the chunk ([rows, seq_len + 1] int64), each node's put in place; a
        failed chunk raised: this rank's own error, else one naming the first node that failed."""
        statuses = found.statuses()  # raises when nothing was received
        recv = cast(torch.Tensor, found.recv).numpy()
        if found.error is not None:
            if isinstance(found.error, UserError):
                found.error.per_rank = True  # this rank's own read: its launch prints it here (its peers name it)
            raise found.error
        failed = next(((node, status) for node, status in enumerate(statuses) if status != OK), None)
        if failed is not None:
            raise peer_error(failed[0], failed[1], self._steps(chunk))
        rows = np.empty((found.rows, self.reader.seq_len + 1), dtype=np.int64)
        offset = 0
        for place, size in zip(found.places, found.recv_bytes):
            rows[place] = recv[offset + HEADER:offset + size].view(TOKEN_DTYPE).reshape(len(place), rows.shape[1])
            offset += size
        return rows

    def _complete(self, chunk: int) -> list[list[Batch]]:
        """Chunk ``chunk``'s exchange waited for, and this rank's micro-batches cut from it."""
        found = self._issued.pop(chunk)
        _wait(found)
        rows = self._unpack(chunk, found)
        if chunk in self._agreed:  # another group's read failed: every rank stops here
            raise peer_error(*self._agreed[chunk], self._steps(chunk))
        layout = self.layout
        tensor = torch.from_numpy(rows).view(-1, layout.grad_accum, layout.micro_batch, rows.shape[1])  # [steps, ga, mb, L+1]
        return [[self._finish(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()) for batch in step]
                for step in tensor]

    def get(self, step: int) -> list[Batch]:
        """This rank's micro-batches of ``step``. Ranks ask for the same steps in the same order
        (a stage's steps, or a resume's): the exchanges they start are the same."""
        if self.closed:
            raise RuntimeError("batches asked of a closed row exchange")
        if not 0 <= step < self.plan_steps:
            raise ReaderError(f"step {step} needs global rows up to {(step + 1) * self.global_batch}, but the plan "
                              f"holds {self.reader.num_rows} rows; automatic dataset repetition is forbidden")
        started = time.perf_counter()
        chunk = step // self.chunk_steps
        try:
            if self._batches[0] != chunk:
                self._due(chunk)
                self._issue_owed(through=chunk)
                self._batches = (-1, [])
                batches = self._complete(chunk)
                self._settle()  # anything else issued (never, in step order)
                self._batches = (chunk, batches)
                if (chunk + 1) * self.chunk_steps < self.end:
                    self._owe(chunk + 1)
                    self._prepare_soon(chunk + 2)
            self._issue_owed()  # a part whose read is done, sent at once
            return self._batches[1][step - chunk * self.chunk_steps]
        finally:
            self.wait_s += time.perf_counter() - started

    def _due(self, chunk: int) -> None:
        """Chunk ``chunk``'s exchange owed, unless it is already (a stage's first step, a step
        asked out of order: what was in flight is settled first)."""
        if chunk not in self._issued and chunk not in self._owed:
            self._issue_owed(through=max(self._owed, default=-1))
            self._settle()
            self._owe(chunk)

    def readiness(self, step: int) -> Readiness:
        """Before ``step`` (every rank asks, in the stop agreement): (1 while this rank's part of
        the step's exchange is still being read, the status of a failed part, this node + 1 then).
        Nothing to wait for at a step inside a chunk."""
        chunk = step // self.chunk_steps
        if self.closed or not 0 <= step < self.end or self._batches[0] == chunk:
            return 0, OK, 0
        if not self._issued and not self._owed:  # the stage's first step: owed from now on
            self._owe(chunk)
        self._issue_owed()
        if chunk in self._owed:
            return 1, OK, 0
        found = self._issued.get(chunk)
        if found is None or found.error is None:
            return 0, OK, 0
        return 0, status_of(found.error), self.node + 1

    def agreed(self, step: int, status: int, node: int) -> None:
        """What the agreement found before ``step``: a rank's failed read (``status`` sent by
        node ``node`` - 1), raised at that step by every rank whose own exchange did not."""
        if status != OK and node > 0:
            self._agreed[step // self.chunk_steps] = (node - 1, status)

    def start(self, step: int) -> None:
        """Read this node's rows of ``step``'s chunk and the next now, in the background (a
        stage's first step, while the model is built: its first ``get`` starts both exchanges);
        no collective is started here."""
        if self.closed:
            raise RuntimeError("start of a closed row exchange")
        if 0 <= step < self.end:
            self._prepare_soon(step // self.chunk_steps)
            self._prepare_soon(step // self.chunk_steps + 1)

    def _settle(self) -> None:
        """Wait for every exchange in flight (every member started it: it completes; a failed
        one raises here, as the next exchange would)."""
        for chunk in list(self._issued):
            _wait(self._issued.pop(chunk))

    def request_stop(self) -> None:
        """Drop the reads not begun yet (never blocks); a later ``get`` reads them again."""
        self._prepared = {chunk: future for chunk, future in self._prepared.items()
                          if chunk in self._owed or not future.cancel()}

    def close(self) -> None:
        """Send every part still owed with a "stopped" status (every rank stops at one step:
        each member sent its part of the same exchanges, none waits for a read), wait for the
        exchanges in flight (``CLOSE_WAIT_S`` in all: a member gone, they are aborted) and
        leave the read thread (a daemon) to end with the process when it is still in a download."""
        if self.closed:
            return
        self.closed = True
        self.request_stop()
        for chunk in self._owed:
            found = self._failed(chunk)
            found.fail(None, STOPPED)
            self._send(chunk, found)
        self._owed.clear()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for found in self._issued.values():
            try:
                _wait(found, datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except RuntimeError:  # a peer gone, or timed out: nothing of it is used now
                if self.group is not None:
                    with contextlib.suppress(RuntimeError):
                        self.group.abort()  # its queued operations would hold the process's exit
                break
        self._issued.clear()
        self._todo.put(None)
        self._thread.join(JOIN_S)
        self._prepared.clear()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
