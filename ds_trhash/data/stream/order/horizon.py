"""Which shards a replay plan reads over a span of global rows, in the order of their first read.

What a prefetch by the plan asks of the node cache (``reader``, ``exchange``): every shard any
rank of the job may read between two points of the plan, so that each is fetched before the
first read needs it. Arithmetic on the sources' rows (``order.Segment``): no shuffle window is
built, and the answer is remembered for the last span asked.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from ds_trhash.data.stream.order.segment import Segment
from ds_trhash.data.stream.types import Key

KEYS_AT_MOST = 64  # shards named ahead at most (the cache takes the first few it lacks)


class PlanHorizon:
    """The shards of ``segments`` (the plan's passes laid end to end), read in shuffle windows of
    ``window_size`` rows (a window's rows are read in any order)."""

    def __init__(self, segments: Sequence[Segment], window_size: int) -> None:
        self.segments, self.window_size = list(segments), int(window_size)
        self._starts = [segment.start for segment in self.segments]
        self._num_rows = self.segments[-1].start + self.segments[-1].length if self.segments else 0
        self._memo: tuple[tuple[int, int], tuple[Key, ...]] = ((-1, -1), ())

    def keys(self, first: int, rows: int) -> tuple[Key, ...]:
        """Every shard the plan reads from the start of the window after the one holding global
        row ``first`` to the end of the window holding row ``first + rows - 1``, in order of first
        read (by window, then source and file), at most ``KEYS_AT_MOST``."""
        size = self.window_size
        index = bisect.bisect_right(self._starts, first) - 1
        start = self.segments[index].start + ((first - self.segments[index].start) // size + 1) * size
        end = self.window_end(min(self._num_rows, first + rows))
        if self._memo[0] != (start, end):
            memo_key, found = (start, end), list[tuple[int, str, str]]()
            while start < end and index < len(self.segments) and len(found) < KEYS_AT_MOST:
                segment = self.segments[index]
                stop = min(end, segment.start + segment.length)
                if start < stop:
                    found.extend(self._first_reads(segment, start - segment.start, stop - segment.start))
                index += 1
                start = max(start, stop)
            keys = ((source, file) for _, source, file in sorted(found))
            self._memo = (memo_key, tuple(dict.fromkeys(keys))[:KEYS_AT_MOST])
        return self._memo[1]

    def window_end(self, row: int) -> int:
        """The end of the shuffle window holding global row ``row - 1`` (its rows are read in any
        order, so a horizon that reaches into a window takes all of it)."""
        if row <= 0:
            return 0
        segment = self.segments[bisect.bisect_right(self._starts, row - 1) - 1]
        size = self.window_size
        return min(segment.start + segment.length, segment.start + -(-(row - segment.start) // size) * size)

    def _first_reads(self, segment: Segment, a: int, b: int) -> list[tuple[int, str, str]]:
        """(global row of the window it is first read in, source, file) of each shard read in
        segment positions [a, b), at most ``KEYS_AT_MOST`` per source."""
        size, out = self.window_size, []
        served_a, served_b = segment.served_before(a), segment.served_before(b)
        for s, source in enumerate(segment.sources):
            if served_b[s] <= served_a[s]:
                continue
            low = bisect.bisect_right(source.starts, served_a[s]) - 1
            high = bisect.bisect_right(source.starts, served_b[s] - 1)
            for i in range(low, min(high, low + KEYS_AT_MOST)):
                position = segment.position(s, max(source.starts[i], served_a[s]))
                out.append((segment.start + position // size * size, source.name, source.files[i]))
        return out
