"""`data tokenize` progress: rows, tokens, rate and time left, on stderr.

An hour-long tokenization must show that it moves. On a terminal a rich live line is redrawn in
place; anywhere else (a log file, a job scheduler, a pipe) a plain self-contained line is printed
every ``every`` seconds, and once at the end in both cases. stdout keeps only the command's result.

Time left comes from how far the parent has read into the inputs: plain text and JSONL files by
the bytes of the records read, Parquet files by rows against their metadata, each input weighted
by its size on disk. A compressed file or a streamed dataset has no known end, so the line then
shows the rate without a time left. The rows counted are the records of the chunks stored.
"""
from __future__ import annotations

import datetime as _dt
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO, cast

from ds_trhash.data.build.inputs import JSONL, TEXT, InputSpec, Record, Skipped

if TYPE_CHECKING:  # rich is imported where a live line is drawn
    from rich.text import Text

__all__ = ["TokenizeProgress"]


def _duration(seconds: float) -> str:
    return str(_dt.timedelta(seconds=int(max(0.0, seconds))))


def _extent(spec: InputSpec) -> tuple[float, str] | None:
    """(the input's weight in bytes, how its reading is measured: "bytes" or "rows"); None: unknown."""
    if spec.path is None or spec.path.name.lower().endswith(".gz"):
        return None
    size = float(max(1, spec.path.stat().st_size))
    return size, ("rows" if spec.fmt == "parquet" else "bytes")


def _parquet_rows(spec: InputSpec) -> int:
    import pyarrow.parquet as pq  # only for Parquet inputs, as in inputs.py

    try:
        return max(1, pq.ParquetFile(spec.path).metadata.num_rows)
    except Exception:  # a damaged file: the reader refuses it with its own message
        return 1


class TokenizeProgress:
    """``observe`` wraps the record stream (what was read), ``chunk`` counts each stored chunk."""

    def __init__(self, source: str, inputs: Sequence[InputSpec], *, stream: TextIO | None = None,
                 every: float = 30.0, clock: Callable[[], float] = time.monotonic, live: bool | None = None):
        self.source, self.stream, self.every, self.clock = source, stream or sys.stderr, every, clock
        extents = [_extent(spec) for spec in inputs]
        self.known = all(e is not None for e in extents)
        self.weights = [e[0] if e else 0.0 for e in extents]
        self.ends = [(_parquet_rows(s) if e[1] == "rows" else e[0]) if e else 1.0 for s, e in zip(inputs, extents)]
        self.read = [0.0] * len(extents)
        self.current = 0
        self.rows = self.tokens = self.records_read = 0
        self.started = self.last = clock()
        self._live = None
        if live if live is not None else self.stream.isatty():
            from rich.console import Console  # lazy: only a terminal gets the live line
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), refresh_per_second=4, transient=False)
            self._live.start()

    def observe(self, items: Iterator[Record | Skipped]) -> Iterator[Record | Skipped]:
        for item in items:
            if isinstance(item, Skipped):  # Parquet rows of another part, read past
                self.read[self.current] += item.count
                self.records_read += item.count
            else:
                self.current = item.source
                self.read[item.source] += len(cast(bytes, item.raw)) + 1 if item.kind in (TEXT, JSONL) else 1
                self.records_read += 1
            yield item

    def fraction(self) -> float | None:
        """How much of the input is tokenized, or None when its end is unknown."""
        if not self.known or not self.records_read:
            return None
        total = sum(self.weights)
        done = sum(w * (1.0 if i < self.current else min(1.0, r / end))
                   for i, (w, r, end) in enumerate(zip(self.weights, self.read, self.ends)))
        return min(1.0, done / total * self.rows / self.records_read) if total else None

    def line(self) -> str:
        elapsed = max(1e-9, self.clock() - self.started)
        text = (f"tokenize {self.source}: {self.rows:,} rows, {self.tokens:,} tokens, "
                f"{self.tokens / elapsed:,.0f} tokens/s, {_duration(elapsed)} elapsed")
        done = self.fraction()
        if done:
            text += f", {100 * done:.0f}%, time left {_duration(elapsed * (1 - done) / done)}"
        return text

    def _text(self) -> Text:
        from rich.text import Text  # the line as it is: no number highlighting

        return Text(self.line())

    def chunk(self, record: dict[str, Any]) -> None:
        self.rows += int(record.get("records", 0))
        self.tokens += int(record.get("tokens", 0))
        if self._live is not None:
            self._live.update(self._text())
        elif self.clock() - self.last >= self.every:
            self.last = self.clock()
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        self.current = len(self.weights)  # every input read to its end (a failed run has rows < records read)
        if self._live is not None:
            self._live.update(self._text())
            self._live.stop()
        else:
            print(self.line(), file=self.stream, flush=True)
