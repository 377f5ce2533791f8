"""Global row order of a replay plan and the per-rank batches cut from it.

The order is a pure function of (plan, seed, shuffle_window), never of world size or of
how far a run got, so a resume only needs the global row cursor:

1. Phases in plan order; a phase with ``passes = p`` is walked p times (one *segment* each).
2. Within a segment, sources interleave by weighted fair queuing (docs/contracts.md §2): the next row
   comes from the source with the smallest served/weight, weight = the source's row count
   in the phase, ties to the smaller source name. Source s's k-th row thus sits at the
   rank of the key (k / n_s, name) among all keys, which is computed arithmetically, so
   no per-row table is ever built (a 130B-token plan has ~63M rows).
3. The seed permutes rows inside consecutive windows of ``shuffle_window`` rows of each
   segment (numpy PCG64 seeded by (seed, phase, pass, window)). Windows keep shard locality,
   so a bounded cache with prefetch keeps up; ``shuffle_window=0`` keeps the WFQ order.

Step s of global batch G covers global rows [s·G, (s+1)·G); micro-step m of rank r takes
the ``micro_batch`` rows starting at s·G + (m·world_size + r)·micro_batch. The set of rows
in an optimizer step therefore depends on G only.
"""
from __future__ import annotations

import bisect
import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ds_trhash.errors import UserError

from ds_trhash.data.stream.cache import ShardCache
from ds_trhash.data.formats.layout import sources_dir
from ds_trhash.data.plans.plan import PlanLike, plan_doc, validate_plan_doc
from ds_trhash.data.formats.shards import read_rows
from ds_trhash.data.formats.tokenizer import PathLike


DEFAULT_SHUFFLE_WINDOW = 4096
_COMPUTE_CHUNK = 4096  # rows computed at once when not shuffling
_WINDOWS_KEPT = 8
_LOOKAHEAD_MICRO_BATCHES = 2

RowRef = tuple[str, str, int]  # (source, file, row within the file)


class ReaderError(UserError, ValueError):
    """A batch asks for rows the plan does not hold, or a batch layout is invalid."""


@dataclass(frozen=True)
class _SourceRows:
    """One source's rows in one phase: entries laid end to end."""

    name: str
    files: tuple[str, ...]
    starts: tuple[int, ...]  # first source-row index of each entry
    total: int

    @classmethod
    def of(cls, name: str, entries: list[dict]) -> "_SourceRows":
        starts, total = [], 0
        for entry in entries:
            starts.append(total)
            total += int(entry["rows"])
        return cls(name, tuple(e["file"] for e in entries), tuple(starts), total)

    def locate(self, k: int) -> RowRef:
        index = bisect.bisect_right(self.starts, k) - 1
        return self.name, self.files[index], k - self.starts[index]


@dataclass(frozen=True)
class _Segment:
    """One pass over one phase, in weighted-fair-queuing order."""

    start: int
    phase_index: int
    pass_index: int
    phase_name: str
    sources: tuple[_SourceRows, ...]  # sorted by name

    @property
    def length(self) -> int:
        return sum(s.total for s in self.sources)

    def _position(self, s: int, k: int) -> int:
        """Rank of source s's k-th row: rows of other sources whose key sorts before (k/n_s, s)."""
        n_s, rank = self.sources[s].total, k
        for t, other in enumerate(self.sources):
            if t < s:
                rank += min(other.total, k * other.total // n_s + 1)
            elif t > s:
                rank += min(other.total, -(-k * other.total // n_s))
        return rank

    def _served_before(self, position: int) -> list[int]:
        """For each source, how many of its rows come before ``position``."""
        counts = []
        for s, source in enumerate(self.sources):
            lo, hi = 0, source.total
            while lo < hi:
                mid = (lo + hi) // 2
                if self._position(s, mid) < position:
                    lo = mid + 1
                else:
                    hi = mid
            counts.append(lo)
        return counts

    def order(self, a: int, b: int) -> list[RowRef]:
        """Rows at segment positions [a, b) in WFQ order."""
        first, last = self._served_before(a), self._served_before(b)
        keyed = [
            (Fraction(k, source.total), s, k)
            for s, source in enumerate(self.sources)
            for k in range(first[s], last[s])
        ]
        keyed.sort()
        assert len(keyed) == b - a, "weighted fair queuing ranks are inconsistent"
        return [self.sources[s].locate(k) for _, s, k in keyed]


class ReplayReader:
    def __init__(
        self,
        plan: PlanLike,
        shards_dir: Optional[PathLike],
        seed: int,
        cache: Optional[ShardCache] = None,
        *,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
    ) -> None:
        doc = plan_doc(plan)
        validate_plan_doc(doc)
        if cache is None and shards_dir is None:
            raise ReaderError("ReplayReader needs shards_dir or a ShardCache to read shards from")
        if seed < 0 or shuffle_window < 0:
            raise ReaderError(f"seed ({seed}) and shuffle_window ({shuffle_window}) must be >= 0")
        self.seq_len = int(doc["seq_len"])
        self.seed = int(seed)
        self.shuffle_window = int(shuffle_window)
        self.shards_dir = sources_dir(shards_dir) if shards_dir is not None else None  # either layout
        self.cache = cache
        self.segments: list[_Segment] = []
        start = 0
        for phase_index, phase in enumerate(doc["phases"]):
            sources = tuple(_SourceRows.of(name, phase["sources"][name]) for name in sorted(phase["sources"]))
            for pass_index in range(int(phase["passes"])):
                segment = _Segment(start, phase_index, pass_index, phase["name"], sources)
                self.segments.append(segment)
                start += segment.length
        self.num_rows = start
        self._segment_starts = [segment.start for segment in self.segments]
        self._windows: OrderedDict[tuple[int, int], list[RowRef]] = OrderedDict()

    # -- order -------------------------------------------------------------------------
    def _window_size(self) -> int:
        return self.shuffle_window or _COMPUTE_CHUNK

    def _window(self, segment_index: int, window_index: int) -> list[RowRef]:
        key = (segment_index, window_index)
        if key in self._windows:
            self._windows.move_to_end(key)
            return self._windows[key]
        segment, size = self.segments[segment_index], self._window_size()
        a = window_index * size
        rows = segment.order(a, min(a + size, segment.length))
        if self.shuffle_window:
            entropy = [self.seed, segment.phase_index, segment.pass_index, window_index]
            perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))).permutation(len(rows))
            rows = [rows[i] for i in perm]
        self._windows[key] = rows
        if len(self._windows) > _WINDOWS_KEPT:
            self._windows.popitem(last=False)
        return rows

    def global_rows(self, start: int, count: int) -> list[RowRef]:
        """(source, file, row) of global rows [start, start + count)."""
        if start < 0 or count < 0 or start + count > self.num_rows:
            raise ReaderError(
                f"rows [{start}, {start + count}) are outside the plan's {self.num_rows} rows; "
                "automatic dataset repetition is forbidden"
            )
        out: list[RowRef] = []
        position, end, size = start, start + count, self._window_size()
        while position < end:
            index = bisect.bisect_right(self._segment_starts, position) - 1
            segment = self.segments[index]
            local = position - segment.start
            window = self._window(index, local // size)
            offset = local % size
            take = min(end - position, len(window) - offset)
            out.extend(window[offset : offset + take])
            position += take
        return out

    def phase_at(self, global_row: int) -> str:
        """Name of the phase a global row belongs to (for progress displays)."""
        if not 0 <= global_row < self.num_rows:
            raise ReaderError(f"row {global_row} is outside the plan's {self.num_rows} rows")
        return self.segments[bisect.bisect_right(self._segment_starts, global_row) - 1].phase_name

    # -- batches -----------------------------------------------------------------------
    @staticmethod
    def _first_row(step: int, micro_step: int, rank: int, world_size: int, micro_batch: int, grad_accum: int) -> int:
        global_batch = micro_batch * grad_accum * world_size
        return step * global_batch + (micro_step * world_size + rank) * micro_batch

    def _pinned(self, source: str, file: str):
        """The shard's local path, pinned in the cache (never evicted) while it is read."""
        if self.cache is not None:
            return self.cache.pinned(source, file)
        return contextlib.nullcontext(self.shards_dir / source / file)

    def batch(
        self, step: int, micro_step: int, rank: int, world_size: int, micro_batch: int, grad_accum: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each int64 [micro_batch, seq_len], of this rank's micro-batch."""
        if min(world_size, micro_batch, grad_accum) < 1 or not 0 <= rank < world_size:
            raise ReaderError(
                f"invalid batch layout: rank {rank}, world_size {world_size}, micro_batch {micro_batch}, "
                f"grad_accum {grad_accum}"
            )
        if not 0 <= micro_step < grad_accum or step < 0:
            raise ReaderError(f"micro_step {micro_step} must lie in [0, {grad_accum}) and step {step} be >= 0")
        global_batch = micro_batch * grad_accum * world_size
        if (step + 1) * global_batch > self.num_rows:
            raise ReaderError(
                f"step {step} needs global rows up to {(step + 1) * global_batch}, but the plan holds "
                f"{self.num_rows} rows; automatic dataset repetition is forbidden"
            )
        first = self._first_row(step, micro_step, rank, world_size, micro_batch, grad_accum)
        refs = self.global_rows(first, micro_batch)
        windows = self._read(refs)
        if self.cache is not None:
            self._plan_cache(refs, step, micro_step, rank, world_size, micro_batch, grad_accum)
        tensor = torch.from_numpy(windows)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def _read(self, refs: list[RowRef]) -> np.ndarray:
        """Read the rows, one memory-mapped pass per shard file."""
        out = np.empty((len(refs), self.seq_len + 1), dtype=np.int64)
        by_file: dict[tuple[str, str], list[int]] = {}
        for index, (source, file, _) in enumerate(refs):
            by_file.setdefault((source, file), []).append(index)
        for (source, file), indices in by_file.items():
            with self._pinned(source, file) as path:
                out[indices] = read_rows(path, [refs[i][2] for i in indices], self.seq_len)
        return out

    def _plan_cache(self, refs: list[RowRef], step: int, micro_step: int, rank: int, world_size: int,
                    micro_batch: int, grad_accum: int) -> None:
        """Prefetch this rank's next micro-batches' shards, in plan order."""
        upcoming: list[tuple[str, str]] = []
        for _ in range(_LOOKAHEAD_MICRO_BATCHES):
            micro_step += 1
            if micro_step == grad_accum:
                step, micro_step = step + 1, 0
            first = self._first_row(step, micro_step, rank, world_size, micro_batch, grad_accum)
            if first + micro_batch > self.num_rows:
                break
            for source, file, _ in self.global_rows(first, micro_batch):
                if (source, file) not in upcoming:
                    upcoming.append((source, file))
        self.cache.prefetch(upcoming)
