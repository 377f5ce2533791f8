"""``metrics.csv``: one row per logged event, written by rank 0 only (docs/contracts.md §8).

The column set is fixed so that every run of every stage can be read by the same tools, and
so that a resumed run can keep appending to its file. A file with another header is refused
rather than extended: mixed column sets would silently shift values under the wrong names.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

from ds_trhash.training.records.csv_log import CsvLog, MetricsError
from ds_trhash.training.records.files import METRICS_FILE

__all__ = ["COLUMNS", "METRICS_FILE", "MetricsError", "MetricsWriter", "perplexity"]

COLUMNS = (
    "step", "epoch", "train_loss", "train_ppl", "lr", "tok_s", "tokens_seen", "supervised_tokens",
    "eval_loss", "eval_ppl", "eval_tokens", "label_valid", "label_ignored", "label_out_of_range",
    "experts_backend", "loss_backend", "norm_backend",
    # appended later, so older readers keep their column positions
    "train_loss_avg", "grad_norm", "step_time",
)
# exp(100) ~ 2.7e43 is far beyond any meaningful perplexity and still finite in float64; a
# diverged loss then reads as a huge number instead of breaking the CSV with "inf".
PPL_LOSS_CAP = 100.0
_FORMATS = {"train_loss": ".6f", "eval_loss": ".6f", "train_loss_avg": ".6f", "grad_norm": ".6e",
            "step_time": ".4f", "train_ppl": ".4f", "eval_ppl": ".4f",
            "lr": ".6e", "tok_s": ".1f", "epoch": ".4f"}


def perplexity(loss: float | None) -> float | None:
    if loss is None or math.isnan(loss):
        return None
    return math.exp(min(loss, PPL_LOSS_CAP))


def _cell(column: str, value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        raise MetricsError(f"metrics column {column}: got a bool {value!r}; expected a number or text")
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, _FORMATS[column]) if column in _FORMATS else repr(value)
    return str(value)


class MetricsWriter:
    """Appends rows to ``path`` (normally ``<output_dir>/metrics.csv``) on rank 0.

    ``resume_step``: when an exact resume restarts at that step, rows already written for
    later steps (logged before the crash, after the checkpoint) are dropped, so the file
    keeps one history without duplicated steps (``CsvLog``).
    """

    def __init__(self, path: str | os.PathLike, rank: int, resume_step: int | None = None,
                 on_row: Callable[[int, dict], None] | None = None):
        self.path = Path(path)
        self.rank = rank
        self.on_row = on_row  # also told every row, e.g. the DeepSpeed monitors (training.records.monitor)
        self._log = CsvLog(self.path, COLUMNS, rank, resume_step)

    def write(self, step: int, **values: object) -> None:
        """One row; missing columns stay empty. ``train_ppl``/``eval_ppl`` follow from the losses."""
        unknown = sorted(set(values) - set(COLUMNS))
        if unknown:
            raise MetricsError(f"unknown metrics column(s) {unknown}; allowed: {', '.join(COLUMNS)}")
        if not self._log.writes:
            return
        row = dict(values, step=step)
        for loss_key, ppl_key in (("train_loss", "train_ppl"), ("eval_loss", "eval_ppl")):
            loss = row.get(loss_key)
            if isinstance(loss, (int, float)) and row.get(ppl_key) is None:
                row[ppl_key] = perplexity(float(loss))
        self._log.append([[_cell(c, row.get(c)) for c in COLUMNS]])
        if self.on_row is not None:
            self.on_row(step, row)

    def close(self) -> None:
        self._log.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
