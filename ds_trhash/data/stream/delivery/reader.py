"""A replay plan's rows read for one rank: the per-rank batches cut from the plan's global order.

The global row order is the plan's (``order.PlanOrder``): a pure function of (plan, seed,
shuffle_window), never of world size or of how far a run got, so a resume only needs the global
row cursor. This module reads it.

Step s of global batch G covers global rows [s·G, (s+1)·G); micro-step m of rank r takes
the ``micro_batch`` rows starting at s·G + (m·world_size + r)·micro_batch. The set of rows
in an optimizer step therefore depends on G only.

Shards are read through a working set (``working_set``): a shard is checked, held and mapped
once when a micro-batch of this rank first needs it, and released once its last few
micro-batches have not read it and the next ones (those it prefetches for) do not need it, so a
micro-batch of shards already in the set touches no file.

Prefetch follows the plan in time: the reader asks the node cache for the shards it will read
next in the order of their first read: those of its next micro-batches, its rows of the next
shuffle window, then every shard the plan reads before ``prefetch_s`` seconds from now at the
pace measured so far (a shard of a window is wanted at the window's first row, since the
shuffle may put any of its rows there). The cache fetches the first few of them it does not
hold yet (``prefetch`` of them, the room its bound keeps) and holds them until they are read.
"""
from __future__ import annotations

import itertools
import operator
import time
from collections import OrderedDict
from typing import Iterable, NamedTuple, Optional

import numpy as np
import torch

from ds_trhash.batch_layout import BatchLayout
from ds_trhash.data.formats.layout import shard_path_under, sources_dir
from ds_trhash.data.formats.shards import TOKEN_DTYPE
from ds_trhash.data.formats.tokenizer import PathLike
from ds_trhash.data.plans.plan import PlanLike, plan_doc, validate_plan_doc
from ds_trhash.data.stream.cache import ShardCache
from ds_trhash.data.stream.delivery.working_set import WorkingSet
from ds_trhash.data.stream.mapped_shard import MappedShard
from ds_trhash.data.stream.order import DEFAULT_SHUFFLE_WINDOW, PlanHorizon, PlanOrder, ReaderError, RowRef, Segment
from ds_trhash.data.stream.types import Key

_LOOKAHEAD_MICRO_BATCHES = 32  # whose shards are prefetched (and stay in the working set); looked at every 32nd
_RECENT_MICRO_BATCHES = 8  # a shard none of these read leaves the working set
_ROWS_MEMO = 72  # more than the micro-batches one look names
DEFAULT_PREFETCH_S = 600.0  # prefetch the shards read within the next 10 minutes (data.prefetch_minutes)
# The pace is measured once the reader has run this long; until then: two windows. Short, so that
# a fast reader does not spend its pass only two windows ahead (docs/performance.md, "Shard streaming").
_PACE_AFTER_S = 0.2
_SHARD_OF = operator.itemgetter(0, 1)  # (source, file) of a RowRef


class _FarLook(NamedTuple):
    """The last look past the next micro-batches (``_far_ahead``), reused while it holds."""
    low: int  # the global rows [low, high) of the shuffle window it was made in
    high: int
    when: float  # monotonic time of the look
    keys: tuple[Key, ...]  # this rank's shards of the next window, then the plan's within the horizon


class _Asked(NamedTuple):
    """What the cache was asked at the last prefetch call (``_prefetch``)."""
    upcoming: tuple[Key, ...]  # the next micro-batches' shards
    generation: Optional[int]  # None when all was queued, else the cache's generation then
    ahead: tuple[Key, ...]  # the shards after them (``_far_ahead``)


class ReplayReader:
    def __init__(
        self,
        plan: PlanLike,
        shards_dir: Optional[PathLike],
        seed: int,
        cache: Optional[ShardCache] = None,
        *,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        prefetch_s: float = DEFAULT_PREFETCH_S,
    ) -> None:
        doc = plan_doc(plan)
        validate_plan_doc(doc)
        if cache is None and shards_dir is None:
            raise ReaderError("ReplayReader needs shards_dir or a ShardCache to read shards from")
        self.order = PlanOrder(doc, seed, shuffle_window)
        self.seq_len = int(doc["seq_len"])
        self.seed, self.shuffle_window = self.order.seed, self.order.shuffle_window
        self.prefetch_s = max(0.0, float(prefetch_s))
        self._pace_start: Optional[tuple[float, int]] = None  # (monotonic time, global row) of the first look
        self._far = _FarLook(0, 0, 0.0, ())
        self.shards_dir = sources_dir(shards_dir) if shards_dir is not None else None  # either layout
        self.cache = cache
        self.segments: list[Segment] = self.order.segments
        self.num_rows = self.order.num_rows
        self.horizon = PlanHorizon(self.segments, self.order.window_size)  # the plan's shards over a span of rows
        self._rows_memo: OrderedDict[tuple[int, int], tuple[list[RowRef], tuple[Key, ...]]] = OrderedDict()
        self._prefetched: Optional[_Asked] = None  # None: the cache was never asked
        self._looked: tuple[Key, ...] = ()  # the shards ahead at the last look (and as a set), and the first rows of
        self._looked_named: frozenset[Key] = frozenset()
        self._looked_next: frozenset[int] = frozenset()  # the micro-batches after it that reuse that look
        self._ahead_memo: dict[tuple[int, int, BatchLayout], tuple[Key, ...]] = {}
        budget = cache.hold_budget if cache is not None else None
        self._working = WorkingSet(self._open_shard, budget, cache.expected_size if cache is not None else None)

    # -- order (the plan's, ``order.PlanOrder``) ------------------------------------------
    def global_rows(self, start: int, count: int) -> list[RowRef]:
        """(source, file, row) of global rows [start, start + count)."""
        return self.order.global_rows(start, count)

    def phase_at(self, global_row: int) -> str:
        """Name of the phase a global row belongs to (for progress displays)."""
        return self.order.phase_at(global_row)

    # -- batches -----------------------------------------------------------------------
    def _open_shard(self, key: Key) -> MappedShard:
        """A shard entering the working set: held and mapped by the cache, or mapped from the
        shard directory (its names checked where they are read)."""
        source, file = key
        if self.cache is not None:
            return self.cache.hold_shard(source, file, self.seq_len)
        if self.shards_dir is None:  # the constructor refuses a reader with neither
            raise ReaderError("ReplayReader needs shards_dir or a ShardCache to read shards from")
        return MappedShard(key, shard_path_under(self.shards_dir, source, file), self.seq_len)

    @property
    def shard_wait_s(self) -> float:
        """Seconds spent bringing shards into the working set (checks, holds, downloads waited for)."""
        return self._working.open_s

    def close(self) -> None:
        """Release every shard of the working set (the cache itself is its owner's to close)."""
        self._working.close()

    def batch(self, step: int, micro_step: int, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [micro_batch, seq_len], of this rank's micro-batch."""
        rank, world_size = layout.rank, layout.world_size
        micro_batch, grad_accum = layout.micro_batch, layout.grad_accum
        if min(world_size, micro_batch, grad_accum) < 1 or not 0 <= rank < world_size:
            raise ReaderError(
                f"invalid batch layout: rank {rank}, world_size {world_size}, micro_batch {micro_batch}, "
                f"grad_accum {grad_accum}"
            )
        if not 0 <= micro_step < grad_accum or step < 0:
            raise ReaderError(f"micro_step {micro_step} must lie in [0, {grad_accum}) and step {step} be >= 0")
        global_batch = layout.global_batch
        if (step + 1) * global_batch > self.num_rows:
            raise ReaderError(
                f"step {step} needs global rows up to {(step + 1) * global_batch}, but the plan holds "
                f"{self.num_rows} rows; automatic dataset repetition is forbidden"
            )
        first = layout.first_row(step, micro_step)
        refs = self._rows_at(first, micro_batch)[0]
        windows = self._read(refs)
        upcoming: tuple[Key, ...] = ()
        if self.cache is not None:
            moved_on = self._cache_moved_on()
            if first in self._looked_next and not moved_on:  # 31 of 32 micro-batches: what was looked at
                upcoming = self._looked
            else:
                upcoming = self._look_ahead(first, moved_on, step, micro_step, layout)
        self._working.next_read(_RECENT_MICRO_BATCHES, upcoming)
        tensor = torch.from_numpy(windows)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def _look_ahead(self, first: int, moved_on: bool, step: int, micro_step: int,
                    layout: BatchLayout) -> tuple[Key, ...]:
        """The shards of the next micro-batches (kept in the working set), prefetched with those
        of the next window and the plan's horizon. Looked at every 32nd micro-batch of a
        sequential read, not at each: a look costs more than a warm micro-batch's read, and the
        31 after a look were in it, and so is the one after them.
        The cache is asked again only when what it would be asked changed (``_prefetch``): the
        shards named, not their order within the next micro-batches (all are read within them,
        and the order changes at about every other look). The micro-batches in between take the
        last look as it is (``batch``): their time is the warm cache's rate. Figures:
        docs/performance.md, "Shard streaming"."""
        upcoming, self._looked_next = self._upcoming(step, micro_step, layout)
        far = self._far_ahead(first, layout)
        named = frozenset(upcoming)  # their order changes at almost every look; what is named, rarely
        if moved_on or named != self._looked_named or self._prefetched is None or far is not self._prefetched.ahead:
            self._prefetch(upcoming, far)
        self._looked, self._looked_named = upcoming, named
        return upcoming

    def _cache_moved_on(self) -> bool:
        """Ask the cache again: never asked yet, or the last call could not queue everything and
        the cache's state changed since (a shard held, released or fetched)."""
        asked = self._prefetched
        return asked is None or (asked.generation is not None and self.cache is not None
                                 and asked.generation != self.cache.generation)

    def _far_ahead(self, first: int, layout: BatchLayout) -> tuple[Key, ...]:
        """This rank's shards of the next window, then the plan's within the horizon: looked at
        again when ``first`` leaves the window of the last look, or 0.2 s after it (the pace
        may have changed), else the last answer (the same object)."""
        now, last = time.monotonic(), self._far
        if last.low <= first < last.high and now - last.when <= _PACE_AFTER_S:
            return last.keys
        segment, size = self.segments[self.order.segment_of(first)], self.order.window_size
        low = segment.start + (first - segment.start) // size * size
        ahead = self._window_ahead(first, layout)
        later = self.horizon.keys(first, self._horizon_rows(first, now))
        keys = ahead + tuple(k for k in later if k not in ahead)
        if keys == last.keys:
            keys = last.keys
        self._far = _FarLook(low, min(low + size, segment.start + segment.length), now, keys)
        return keys

    def _horizon_rows(self, first: int, now: Optional[float] = None) -> int:
        """How many global rows the plan reads in the next ``prefetch_s`` seconds, at the pace
        this reader has kept since its first look ahead (two windows until that is measured)."""
        now = time.monotonic() if now is None else now
        if self._pace_start is None:
            self._pace_start = (now, first)
        started, row = self._pace_start
        if now - started < _PACE_AFTER_S or first <= row:
            return 2 * self.order.window_size
        return int((first - row) / (now - started) * self.prefetch_s)

    def _prefetch(self, upcoming: tuple[Key, ...], ahead: tuple[Key, ...]) -> None:
        """The next micro-batches' shards first, then this rank's of the next shuffle window (all
        of a window's shards are wanted at its first rows: the micro-batches alone see them too
        late). The cache skips what it holds or has fetched; the caller asks again only when that
        changes: the shards named, or (after a call that could not queue them all) the cache's
        state, remembered here (``_Asked``)."""
        if self.cache is None:  # nothing to fetch ahead without a cache
            return
        generation = self.cache.generation
        complete = self.cache.prefetch(upcoming + tuple(k for k in ahead if k not in upcoming))
        self._prefetched = _Asked(upcoming, None if complete is not False else generation, ahead)

    def _window_ahead(self, first: int, layout: BatchLayout) -> tuple[Key, ...]:
        """The shards of this rank's rows in the window after the one holding global row
        ``first``, within its segment (() at a segment's last window), in order of first use."""
        index = self.order.segment_of(first)
        segment, size = self.segments[index], self.order.window_size
        window = (first - segment.start) // size + 1
        if window * size >= segment.length:
            return ()
        memo_key = (index, window, layout)
        if memo_key not in self._ahead_memo:
            in_window = self.order.window(index, window)
            rows: Iterable[RowRef] = in_window
            if layout.world_size > 1:
                start, per_step, micro_batch = segment.start + window * size, layout.global_batch, layout.micro_batch
                offsets = (start + np.arange(len(in_window))) % per_step // micro_batch % layout.world_size == layout.rank
                rows = itertools.compress(in_window, offsets.tolist())
            self._ahead_memo = {memo_key: tuple(dict.fromkeys(map(_SHARD_OF, rows)))}  # one window at a time
        return self._ahead_memo[memo_key]

    def read_rows(self, refs: list[RowRef], upcoming: tuple[Key, ...], ahead: tuple[Key, ...]) -> np.ndarray:
        """The windows of ``refs`` as stored ([len(refs), seq_len + 1] uint16), read in one go
        through the working set; then ``upcoming`` (the shards of the next read) stay in it and
        are prefetched, with ``ahead`` after them. How a node's rows for its peers are read
        (``exchange``): the caller chooses the shards, this reader only reads them."""
        windows = self._read(refs, TOKEN_DTYPE)
        if self.cache is not None:
            self._prefetch(upcoming, ahead)
        self._working.next_read(1, upcoming)
        return windows

    def horizon_keys(self, first: int) -> tuple[Key, ...]:
        """Every shard the plan reads from the window after global row ``first`` to the
        prefetch horizon (``data.prefetch_minutes`` at the pace measured so far)."""
        return self.horizon.keys(first, self._horizon_rows(first))

    def _read(self, refs: list[RowRef], dtype: np.dtype = np.dtype(np.int64)) -> np.ndarray:
        """Read the rows from the working set's maps, shard by shard."""
        out = np.empty((len(refs), self.seq_len + 1), dtype=dtype)
        by_file: dict[Key, tuple[list[int], list[int]]] = {}
        for index, (source, file, row) in enumerate(refs):
            positions, rows = by_file.setdefault((source, file), ([], []))
            positions.append(index)
            rows.append(row)
        for key, (positions, rows) in by_file.items():
            self._working.get(key).read_into(out, positions, rows)
        return out

    def _rows_at(self, first: int, count: int) -> tuple[list[RowRef], tuple[Key, ...]]:
        """Global rows [first, first + count) and their shards in order of first use, remembered
        for the few micro-batches that are looked ahead at before they are read."""
        found = self._rows_memo.get((first, count))
        if found is None:
            refs = self.global_rows(first, count)
            found = refs, tuple(dict.fromkeys((s, f) for s, f, _ in refs))
            self._rows_memo[(first, count)] = found
            if len(self._rows_memo) > _ROWS_MEMO:
                self._rows_memo.popitem(last=False)
        return found

    def _upcoming(self, step: int, micro_step: int, layout: BatchLayout) -> tuple[tuple[Key, ...], frozenset[int]]:
        """(the shards of this rank's next few micro-batches in plan order, the first rows of
        those of them but the last, which reuse this look: the last one looks again)."""
        following: list[int] = []
        keys: list[tuple[Key, ...]] = []
        for _ in range(_LOOKAHEAD_MICRO_BATCHES):
            micro_step += 1
            if micro_step == layout.grad_accum:
                step, micro_step = step + 1, 0
            first = layout.first_row(step, micro_step)
            if first + layout.micro_batch > self.num_rows:
                break
            following.append(first)
            keys.append(self._rows_at(first, layout.micro_batch)[1])
        upcoming = keys[0] if len(set(keys)) == 1 else tuple(dict.fromkeys(itertools.chain.from_iterable(keys)))
        return upcoming, frozenset(following[:-1])
