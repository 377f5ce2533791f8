"""The weighted-fair-queuing order of one pass over one phase of a replay plan.

Within a segment (one pass over one phase), sources interleave by weighted fair queuing
(docs/contracts.md §2): the next row comes from the source with the smallest served/weight,
weight = the source's row count in the phase, ties to the smaller source name. Source s's k-th
row thus sits at the rank of the key (k / n_s, name) among all keys, which is computed with
integer arithmetic (``Segment.position``), so no per-row table is ever built (a 130B-token plan
has ~63M rows) and a range of rows is placed without a sort (``Segment.order``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, overload

import numpy as np

RowRef = tuple[str, str, int]  # (source, file, row within the file)


@dataclass(frozen=True)
class SourceRows:
    """One source's rows in one phase: entries laid end to end."""

    name: str
    files: tuple[str, ...]
    starts: tuple[int, ...]  # first source-row index of each entry
    total: int

    @classmethod
    def of(cls, name: str, entries: list[dict]) -> "SourceRows":
        starts, total = [], 0
        for entry in entries:
            starts.append(total)
            total += int(entry["rows"])
        return cls(name, tuple(e["file"] for e in entries), tuple(starts), total)


@dataclass(frozen=True)
class Segment:
    """One pass over one phase, in weighted-fair-queuing order."""

    start: int
    phase_index: int
    pass_index: int
    phase_name: str
    sources: tuple[SourceRows, ...]  # sorted by name

    @property
    def length(self) -> int:
        return sum(s.total for s in self.sources)

    def position(self, s: int, k: int) -> int:
        """Rank of source s's k-th row: rows of other sources whose key sorts before (k/n_s, s)."""
        return self._rank(s, k, min)

    def positions(self, s: int, ks: np.ndarray) -> np.ndarray:
        """``position(s, k)`` for every k of ``ks`` at once."""
        return self._rank(s, ks, np.minimum)

    @overload
    def _rank(self, s: int, k: int, minimum: Callable[[int, int], int]) -> int: ...
    @overload
    def _rank(self, s: int, k: np.ndarray, minimum: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray: ...
    def _rank(self, s: int, k: int | np.ndarray, minimum: Callable[..., int | np.ndarray]) -> int | np.ndarray:
        """The one formula of ``position``, for an int or an array of them (``minimum`` to match)."""
        n_s, rank = self.sources[s].total, k
        for t, other in enumerate(self.sources):
            if t < s:
                rank = rank + minimum(other.total, k * other.total // n_s + 1)
            elif t > s:
                rank = rank + minimum(other.total, -(-k * other.total // n_s))
        return rank

    def served_before(self, position: int) -> list[int]:
        """For each source, how many of its rows come before ``position``."""
        counts = []
        for s, source in enumerate(self.sources):
            lo, hi = 0, source.total
            while lo < hi:
                mid = (lo + hi) // 2
                if self.position(s, mid) < position:
                    lo = mid + 1
                else:
                    hi = mid
            counts.append(lo)
        return counts

    def order(self, a: int, b: int) -> list[RowRef]:
        """Rows at segment positions [a, b) in WFQ order: each row placed at its rank
        (``positions``, computed for all of a source's rows at once), no sort, exact."""
        first, last = self.served_before(a), self.served_before(b)
        out: list[Optional[RowRef]] = [None] * (b - a)
        for s, source in enumerate(self.sources):
            if last[s] <= first[s]:
                continue
            ks: np.ndarray = np.arange(first[s], last[s], dtype=self.dtype_for_counts())
            ranks = self.positions(s, ks) - a
            assert 0 <= ranks.min() and ranks.max() < b - a, "weighted fair queuing ranks are inconsistent"
            starts = np.asarray(source.starts, dtype=ks.dtype)
            files = np.searchsorted(starts, ks, side="right") - 1
            within = ks - starts[files]
            for rank, index, row in zip(ranks.tolist(), files.tolist(), within.tolist()):
                out[rank] = (source.name, source.files[index], row)
        assert all(ref is not None for ref in out), "weighted fair queuing ranks are inconsistent"
        return out  # type: ignore[return-value]

    def dtype_for_counts(self) -> type:
        """int64 while k·n_t cannot overflow it (sources under 2^31 rows), else exact Python ints."""
        return np.int64 if max(source.total for source in self.sources) < 2**31 else object
