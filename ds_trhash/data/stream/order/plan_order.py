"""The global row order of a replay plan: which (source, file, row) is global row i.

A pure function of (plan, seed, shuffle_window), never of the world size or of how far a run got,
so a resume needs only the global row cursor:

1. Phases in plan order; a phase with ``passes = p`` is walked p times (one ``Segment`` each).
2. Within a segment, sources interleave by weighted fair queuing (``segment``), computed with
   integer arithmetic: no per-row table is ever built (a 130B-token plan has ~63M rows).
3. The seed permutes rows inside consecutive windows of ``shuffle_window`` rows of each segment
   (numpy PCG64 seeded by (seed, phase, pass, window)). Windows keep shard locality, so a bounded
   cache with prefetch keeps up; ``shuffle_window=0`` keeps the weighted-fair-queuing order.

No file is read here: the reader (``delivery.reader``) cuts its batches from these rows and reads
their tokens; the row exchange and the prefetch horizon place rows and shards with it.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from ds_trhash.data.stream.order.segment import RowRef, Segment, SourceRows
from ds_trhash.errors import UserError

DEFAULT_SHUFFLE_WINDOW = 4096
_COMPUTE_CHUNK = 4096  # rows computed at once when not shuffling
_WINDOWS_KEPT = 8


class ReaderError(UserError, ValueError):
    """A read asks for rows the plan does not hold, or a batch layout is invalid."""


class PlanOrder:
    """The plan's segments end to end, each cut into windows of ``window_size`` rows; the last
    few windows computed are remembered (a reader reads one window after another)."""

    def __init__(self, doc: Mapping, seed: int, shuffle_window: int) -> None:
        if seed < 0 or shuffle_window < 0:
            raise ReaderError(f"seed ({seed}) and shuffle_window ({shuffle_window}) must be >= 0")
        self.seed, self.shuffle_window = int(seed), int(shuffle_window)
        self.window_size = self.shuffle_window or _COMPUTE_CHUNK
        self.segments: list[Segment] = []
        start = 0
        for phase_index, phase in enumerate(doc["phases"]):
            sources = tuple(SourceRows.of(name, phase["sources"][name]) for name in sorted(phase["sources"]))
            for pass_index in range(int(phase["passes"])):
                segment = Segment(start, phase_index, pass_index, phase["name"], sources)
                self.segments.append(segment)
                start += segment.length
        self.num_rows = start
        self._starts = [segment.start for segment in self.segments]
        self._windows: OrderedDict[tuple[int, int], list[RowRef]] = OrderedDict()

    def segment_of(self, global_row: int) -> int:
        """The index of the segment holding ``global_row``."""
        return bisect.bisect_right(self._starts, global_row) - 1

    def window(self, segment_index: int, window_index: int) -> list[RowRef]:
        """The rows of one window of one segment, shuffled by the seed (when shuffling)."""
        key = (segment_index, window_index)
        if key in self._windows:
            self._windows.move_to_end(key)
            return self._windows[key]
        segment, size = self.segments[segment_index], self.window_size
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
        position, end, size = start, start + count, self.window_size
        while position < end:
            index = self.segment_of(position)
            segment = self.segments[index]
            local = position - segment.start
            window = self.window(index, local // size)
            offset = local % size
            take = min(end - position, len(window) - offset)
            out.extend(window[offset : offset + take])
            position += take
        return out

    def phase_at(self, global_row: int) -> str:
        """Name of the phase a global row belongs to (for progress displays)."""
        if not 0 <= global_row < self.num_rows:
            raise ReaderError(f"row {global_row} is outside the plan's {self.num_rows} rows")
        return self.segments[self.segment_of(global_row)].phase_name
