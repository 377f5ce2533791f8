"""Rows across nodes: each shard filled by one node, the rows the others train on sent to them.

On several nodes reading a Hub store, every shard has one **owner** node (``owners``: a pure
function of the plan and the node count) and only the owner's cache ever fills it, so each shard
leaves the Hub once per job and each node downloads, verifies and stores 1/N of the corpus. The
rows every rank trains on stay those of the one global order (``reader``): bit for bit the same
windows, in the same order, as a rank reading every shard itself.

The rows travel by **chunks** of steps (about ``CHUNK_ROWS`` global rows: one shuffle window) in
the ranks' *exchange group*: the ranks that share this rank's local index, one per node, over gloo
(CPU tensors, beside training's own group). For chunk c:

1. a background thread (``_prepare``) computes from the plan alone which rows each member of the
   group trains on in the chunk, reads those in this node's shards from the node cache (one read,
   ``ReplayReader.read_rows``) and prefetches this node's shards of the next chunk and horizon;
2. the training thread, at the first step of chunk c - 1, sends them with one asynchronous
   ``all_to_all_single`` (each member's part: an 8-byte status, then its rows as stored, uint16);
3. at the first step of chunk c it waits for that exchange (done long since) and cuts its
   micro-batches from its rows, put back in their places.

Every collective is issued by the training thread at a step every rank reaches (the chunk's first
step), so ranks that stop together (a signal, the end of the stage) have issued the same ones and
none is left waiting for a peer. A rank whose read failed (a Hub that stayed away, a corrupt
shard) still takes part, sending a status instead of rows: at the chunk's first step every member
raises, the failing rank its own error, the others one naming that node (``PeerReadError``, a
``StoreUnavailable`` when that was the cause, so each rank's launch says how to relaunch).
"""
from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from ds_trhash.batch_layout import micro_batch_start, step_rows
from ds_trhash.data.formats.shards import TOKEN_DTYPE
from ds_trhash.data.stream.order import RowRef
from ds_trhash.data.stream.reader import ReaderError, ReplayReader
from ds_trhash.data.stream.store.base import StoreUnavailable
from ds_trhash.errors import UserError

Key = tuple[str, str]
Batch = tuple[torch.Tensor, torch.Tensor]
CHUNK_ROWS = 4096  # global rows per exchange (rounded down to whole steps, at least one)
THREAD_NAME = "row-exchange"
_HEADER = 8  # bytes: an int64 status before each member's rows
_OK, _STORE_GONE, _FAILED = 0, 1, 2
CLOSE_WAIT_S = 60.0  # how long close waits for an exchange in flight, or a read (a download) in progress


class NodeLayoutError(UserError, ValueError):
    """The ranks are not whole nodes of one rank count: the exchange groups cannot be formed."""


def node_count(world_size: int, per_node: int) -> int:
    """The nodes of a job of ``world_size`` ranks, ``per_node`` on each (``ranks.ranks_on_node``);
    ranks are numbered node after node, as the launchers number them."""
    if per_node < 1 or world_size % per_node:
        raise NodeLayoutError(
            f"{world_size} ranks are not whole nodes of {per_node} rank(s) each (LOCAL_WORLD_SIZE or LOCAL_SIZE "
            "of this node): rows travel between nodes in groups of one rank per node, so every node must run "
            "the same number of ranks; launch as many processes on each node (the same slots in the hostfile)")
    return world_size // per_node


class PeerReadError(UserError, RuntimeError):
    """Another node could not read the rows it owns for this rank (its own error is in its log)."""


class PeerStoreUnavailable(PeerReadError, StoreUnavailable):
    """As ``PeerReadError``, because the store stayed away longer than that node's wait budget."""


def owners(reader: ReplayReader, nodes: int) -> dict[Key, int]:
    """The node that fills each shard of the plan: each source's files in plan order dealt out
    round-robin, each source (sorted by name) starting one node later than the one before, so the
    shards read side by side at any point of the plan fall to different nodes."""
    files: dict[str, dict[str, None]] = {}
    for segment in reader.segments:
        for source in segment.sources:
            files.setdefault(source.name, {}).update(dict.fromkeys(source.files))
    return {(name, file): (i + s) % nodes
            for s, name in enumerate(sorted(files)) for i, file in enumerate(files[name])}


@dataclass
class _Chunk:
    """One chunk's exchange: what this rank sends each member (the positions of the rows, then the
    bytes: an 8-byte status before each member's part), what it receives from each, and where
    those rows go among its own."""
    refs: list[RowRef]  # the chunk's global rows
    sends: list[np.ndarray]  # per member: positions in ``refs`` of its rows this node owns, its order
    send_bytes: list[int]
    recv_bytes: list[int]
    places: list[np.ndarray]  # per node: where the rows it sends go among this rank's
    rows: int  # this rank's rows in the chunk
    send: np.ndarray = field(init=False)
    error: Optional[BaseException] = None
    recv: Optional[torch.Tensor] = None
    work: object = None

    def __post_init__(self) -> None:
        self.send = np.zeros(sum(self.send_bytes), dtype=np.uint8)  # status _OK (0) and rows to come

    def pack(self, windows: np.ndarray) -> None:
        """The rows read ([sum of sends, seq_len + 1] uint16, the members' parts in turn) put into
        the send buffer after each part's status."""
        offset, row = 0, 0
        for part, size in zip(self.sends, self.send_bytes):
            self.send[offset + _HEADER:offset + size] = windows[row:row + len(part)].reshape(-1).view(np.uint8)
            offset, row = offset + size, row + len(part)

    def fail(self, error: BaseException) -> None:
        """A status instead of rows for every member; ``error`` raised here at the exchange."""
        self.error, offset = error, 0
        status = _STORE_GONE if isinstance(error, StoreUnavailable) else _FAILED
        for size in self.send_bytes:
            self.send[offset:offset + _HEADER].view(np.int64)[0] = status
            offset += size


class RowExchange:
    """This rank's micro-batches, chunk by chunk, from rows read by their shards' owners (see the
    module). The interface of ``assembly.Ahead``: ``get``, ``start``, ``request_stop``, ``close``.

    ``group``: the gloo group of the ranks with this rank's local index, one per node in node
    order (None: the default group, when every node runs one rank); ``node`` / ``nodes``: this
    rank's node and the node count; ``end``: the step the stage stops before."""

    def __init__(self, reader: ReplayReader, micro_batch: int, grad_accum: int, rank: int, world_size: int,
                 node: int, nodes: int, group=None, end: Optional[int] = None, chunk_rows: int = CHUNK_ROWS,
                 finish: Optional[Callable[[torch.Tensor, torch.Tensor], Batch]] = None) -> None:
        if world_size % nodes or not 0 <= node < nodes:
            raise ReaderError(f"world size {world_size} is not {nodes} nodes of equal rank counts (node {node})")
        self.reader, self.micro_batch, self.grad_accum = reader, micro_batch, grad_accum
        self.rank, self.world_size, self.node, self.nodes, self.group = rank, world_size, node, nodes, group
        per_node = world_size // nodes
        self.members = [m * per_node + rank % per_node for m in range(nodes)]  # the group, in node order
        self.global_batch = step_rows(micro_batch, grad_accum, world_size)
        self.chunk_steps = max(1, chunk_rows // self.global_batch)
        self.plan_steps = reader.num_rows // self.global_batch
        self.end = self.plan_steps if end is None else min(int(end), self.plan_steps)
        self.owner = owners(reader, nodes)
        self._finish = finish or (lambda inputs, labels: (inputs, labels))
        self._row_bytes = (reader.seq_len + 1) * TOKEN_DTYPE.itemsize
        # the reader's one thread: a daemon, so that a read stuck in a download never holds up the
        # process's exit (an executor's threads are joined at exit)
        self._todo: queue.SimpleQueue[Optional[tuple[int, Future]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
        self._thread.start()
        self._prepared: dict[int, Future] = {}
        self._refs: dict[int, list[RowRef]] = {}  # the prepare thread's alone
        self._issued: dict[int, _Chunk] = {}
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
        micro-step, row; ``batch_layout.micro_batch_start``)."""
        first = steps.start * self.global_batch
        starts = np.array([micro_batch_start(step, micro, rank, self.micro_batch, self.grad_accum, self.world_size)
                           for step in steps for micro in range(self.grad_accum)]) - first  # [steps · ga]
        return (starts[:, None] + np.arange(self.micro_batch)[None, :]).reshape(-1)

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
    def _layout(self, chunk: int) -> _Chunk:
        """Who sends which rows to whom in chunk ``chunk``: the plan's arithmetic alone, the same
        on every member."""
        steps, refs = self._steps(chunk), self._rows(chunk)
        owner = np.fromiter((self.owner[(s, f)] for s, f, _ in refs), dtype=np.int64, count=len(refs))
        sends = [wanted[owner[wanted] == self.node] for wanted in (self._positions(m, steps) for m in self.members)]
        mine = owner[self._positions(self.rank, steps)]
        places = [np.nonzero(mine == node)[0] for node in range(self.nodes)]
        return _Chunk(refs, sends, [_HEADER + len(part) * self._row_bytes for part in sends],
                      [_HEADER + len(place) * self._row_bytes for place in places], places, len(mine))

    def _read(self, chunk: int, found: _Chunk) -> None:
        """The rows this node owns for every member, read in one go; this node's shards of the
        next chunk and of the horizon named to the cache."""
        upcoming: tuple[Key, ...] = ()
        ahead: tuple[Key, ...] = ()
        following = self._steps(chunk + 1)
        if len(following):
            upcoming = self._keys_owned(self._rows(chunk + 1))
            horizon = self.reader.horizon_keys(following.start * self.global_batch)
            ahead = tuple(key for key in horizon if self.owner[key] == self.node)
        wanted = np.concatenate(found.sends)
        found.pack(self.reader.read_rows([found.refs[i] for i in wanted], upcoming, ahead))

    def _prepare(self, chunk: int) -> _Chunk:
        started = time.perf_counter()
        found = self._layout(chunk)
        try:
            self._read(chunk, found)
        except Exception as exc:  # told to every member at the chunk's exchange, raised there
            found.fail(exc)
        self.assembly_s += time.perf_counter() - started
        return found

    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            chunk, future = item
            if future.set_running_or_notify_cancel():
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

    def _issue(self, chunk: int) -> None:
        """Chunk ``chunk``'s exchange, started (its rows read first if they are not yet)."""
        self._submit(chunk)
        found = self._prepared.pop(chunk).result()
        found.recv = torch.empty(sum(found.recv_bytes), dtype=torch.uint8)
        found.work = dist.all_to_all_single(found.recv, torch.from_numpy(found.send), found.recv_bytes,
                                            found.send_bytes, group=self.group, async_op=True)
        self.sent_bytes += sum(found.send_bytes) - found.send_bytes[self.node] - _HEADER * (self.nodes - 1)
        self._issued[chunk] = found

    def _unpack(self, chunk: int, found: _Chunk) -> np.ndarray:
        """This rank's rows of the chunk ([rows, seq_len + 1] int64), each node's put in place; a
        failed chunk raised: this rank's own error, else one naming the first node that failed."""
        recv = found.recv.numpy()
        rows = np.empty((found.rows, self.reader.seq_len + 1), dtype=np.int64)
        offset, failed = 0, None
        for node, (place, size) in enumerate(zip(found.places, found.recv_bytes)):
            status = int(recv[offset:offset + _HEADER].view(np.int64)[0])
            if status != _OK:
                failed = failed or (node, status)
            else:
                rows[place] = recv[offset + _HEADER:offset + size].view(TOKEN_DTYPE).reshape(len(place), rows.shape[1])
            offset += size
        if found.error is not None:
            raise found.error
        if failed is not None:
            kind, steps = PeerStoreUnavailable if failed[1] == _STORE_GONE else PeerReadError, self._steps(chunk)
            raise kind(f"node {failed[0]} could not read the rows it owns for steps {steps.start}-{steps.stop - 1} "
                       "(its own error is in its log)")
        return rows

    def _complete(self, chunk: int) -> list[list[Batch]]:
        """Chunk ``chunk``'s exchange waited for, and this rank's micro-batches cut from it."""
        found = self._issued.pop(chunk)
        found.work.wait()
        rows = self._unpack(chunk, found)
        tensor = torch.from_numpy(rows).view(-1, self.grad_accum, self.micro_batch, rows.shape[1])  # [steps, ga, mb, L+1]
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
                if chunk not in self._issued:  # a first step, or a step asked out of order
                    self._settle()
                    self._issue(chunk)
                self._batches = (-1, [])
                batches = self._complete(chunk)
                self._settle()  # anything else issued (never, in step order)
                self._batches = (chunk, batches)
                if (chunk + 1) * self.chunk_steps < self.end:
                    self._issue(chunk + 1)
                    self._prepare_soon(chunk + 2)
            return self._batches[1][step - chunk * self.chunk_steps]
        finally:
            self.wait_s += time.perf_counter() - started

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
            self._issued.pop(chunk).work.wait()

    def request_stop(self) -> None:
        """Drop the reads not begun yet (never blocks); a later ``get`` reads them again."""
        self._prepared = {chunk: future for chunk, future in self._prepared.items() if not future.cancel()}

    def close(self) -> None:
        """Wait for the exchange in flight and the read in progress (at most ``CLOSE_WAIT_S``
        each: a read can be a download waiting out an outage)."""
        if self.closed:
            return
        self.closed = True
        self.request_stop()
        for found in self._issued.values():
            with contextlib.suppress(RuntimeError):  # a peer gone, or timed out: nothing of it is used now
                found.work.wait(datetime.timedelta(seconds=CLOSE_WAIT_S))
        self._issued.clear()
        self._todo.put(None)
        self._thread.join(CLOSE_WAIT_S)
        self._prepared.clear()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
