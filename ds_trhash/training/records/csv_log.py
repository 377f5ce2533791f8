"""An append-only CSV file with a fixed header that a resumed run keeps extending.

Shared by ``metrics.csv`` and ``expert_load.csv``: rank 0 writes, every other rank holds no
file; each row is flushed as it is written (a crash loses at most the row being written); a
file whose header differs is refused rather than extended (mixed column sets would put values
under the wrong names); rows after the step a run resumes from, and a row torn by a crash, are
dropped before anything is appended, so the file keeps one history without repeated steps.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Sequence

from ds_trhash.errors import UserError


__all__ = ["CsvLog", "MetricsError"]


class MetricsError(UserError, ValueError):
    """A run's metrics file cannot be written as asked (unknown column, a header from another layout)."""


class CsvLog:
    """``columns[0]`` must be the step. ``resume_step``: rows of later steps are dropped (an
    exact resume at that step, or -1 for a fresh start over an attempt that left no checkpoint);
    None keeps every complete row."""

    def __init__(self, path: str | os.PathLike, columns: Sequence[str], rank: int,
                 resume_step: int | None = None):
        self.path = Path(path)
        self.columns = tuple(columns)
        self._fh = None
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = ",".join(self.columns)
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open("r", encoding="utf-8", newline="") as fh:
                found = fh.readline().rstrip("\r\n")
            if found != header:
                raise MetricsError(
                    f"{self.path}: existing header differs from this trainer's columns; refusing to mix "
                    f"column sets in one file (move the file away or use a new output_dir).\n"
                    f"  found:    {found}\n  expected: {header}")
            if resume_step is not None or not self._ends_with_newline():
                self._truncate_after(resume_step)
            self._fh = self.path.open("a", encoding="utf-8", newline="")
        else:
            self._fh = self.path.open("w", encoding="utf-8", newline="")
            self._fh.write(header + "\n")
            self._fh.flush()

    @property
    def writes(self) -> bool:
        return self._fh is not None

    def append(self, rows: Sequence[Sequence[str]]) -> None:
        """Rows of cells already formatted as text, written and flushed together."""
        if self._fh is None:
            return
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        self._fh.write(buf.getvalue())
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            return fh.read(1) == b"\n"

    def _truncate_after(self, resume_step: int | None) -> None:
        torn = not self._ends_with_newline()
        with self.path.open("r", encoding="utf-8", newline="") as fh:
            rows = list(csv.reader(fh))
        if torn and len(rows) > 1:
            rows.pop()  # a crash mid-write: the last row may be cut anywhere, even inside a cell
        kept = [r for r in rows[1:] if len(r) == len(self.columns) and r[0].isdigit()
                and (resume_step is None or int(r[0]) <= resume_step)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            w.writerow(self.columns)
            w.writerows(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
