"""The numbers a report plots, read from run output directories (finished or still running).

Stages are laid end to end on one step axis, in the order given: stage k starts where stage
k-1 ended, so a pretraining -> refinement -> SFT chain reads left to right. Columns a run did
not record (``grad_norm`` in runs older than that column) come back as ``None`` so the report
can say "not recorded" instead of failing; so does a run without ``expert_load.csv``.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds_trhash.checkpoints import CHECKPOINTS, CheckpointError, list_checkpoints, read_trainer_state
from ds_trhash.errors import UserError
from ds_trhash.io import utf8_lines
from ds_trhash.training.records.files import EXPERT_LOAD_FILE, METRICS_FILE

COLUMNS = ("train_loss", "eval_loss", "lr", "tok_s", "grad_norm", "tokens_seen")


class NotARunError(UserError, ValueError):
    """A directory given as a run holds no training output."""


@dataclass
class ExpertLoad:
    """Route counts per logged interval: ``counts[r, layer, expert]`` over the optimizer steps
    ``from_steps[r] + 1 .. steps[r]`` (both on the shared axis)."""

    steps: list[int]
    from_steps: list[int]
    counts: np.ndarray  # [rows, layers, experts] int64

    @property
    def total(self) -> np.ndarray:
        """[layers, experts] routes over the whole stage."""
        return self.counts.sum(axis=0)


def even_split_multiple(counts: np.ndarray) -> np.ndarray:
    """Counts [..., experts] -> each expert's share of its layer's routes times the number of
    experts: 1.0 is an even split (any leading shape: one interval, all intervals, a stage)."""
    sums = counts.sum(axis=-1, keepdims=True).clip(min=1)
    return counts / sums * counts.shape[-1]


@dataclass
class StageSeries:
    """One run's metrics on the shared step axis (``offset`` + its own step)."""

    run_dir: Path
    stage: str
    offset: int
    steps: dict[str, list[int]] = field(default_factory=dict)
    values: dict[str, list[float]] = field(default_factory=dict)
    recorded: dict[str, bool] = field(default_factory=dict)  # column present in metrics.csv
    last_step: int = 0
    newest_checkpoint: int | None = None
    total_steps: int | None = None
    expert_load: ExpertLoad | None = None  # None: no expert_load.csv (or no complete row yet)

    @property
    def end(self) -> int:
        return self.offset + self.last_step

    @property
    def state(self) -> str:
        if self.newest_checkpoint is not None and self.total_steps is not None \
                and self.newest_checkpoint >= self.total_steps:
            return "finished"
        return "in progress (or stopped before its last step)"


def check_run_dir(path: Path) -> None:
    if not path.is_dir():
        raise NotARunError(f"{path} is not a directory; pass a training output directory (--output-dir of a launch)")
    if not (path / METRICS_FILE).is_file() and not (path / CHECKPOINTS).is_dir():
        raise NotARunError(f"{path} is not a run output directory: it has neither {METRICS_FILE} nor "
                           f"{CHECKPOINTS}/; pass the --output-dir of a training launch")


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and complete rows; a row cut by a crash or by a live writer is left out."""
    if not path.is_file():
        return [], []
    reader = csv.DictReader(utf8_lines(path, NotARunError))
    rows = [r for r in reader if None not in r and None not in r.values()]
    return list(reader.fieldnames or []), rows


def _float(text: str | None) -> float | None:
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_expert_load(path: Path, offset: int) -> ExpertLoad | None:
    """The logged intervals whose rows are there for every layer (a step being written by a live
    run, or cut by a crash, is left out until all its layers are)."""
    _, rows = _rows(path)
    by_step: dict[tuple[int, int], dict[int, list[int]]] = {}
    for r in rows:
        try:
            key, layer = (int(r["step"]), int(r["from_step"])), int(r["layer"])
            experts = [int(v) for k, v in r.items() if k.startswith("expert_")]
        except (KeyError, TypeError, ValueError):
            continue
        by_step.setdefault(key, {})[layer] = experts
    layers = 1 + max((layer for group in by_step.values() for layer in group), default=-1)
    complete = [(key, group) for key, group in sorted(by_step.items()) if sorted(group) == list(range(layers))]
    if not complete:
        return None
    counts = np.array([[group[layer] for layer in range(layers)] for _, group in complete], dtype=np.int64)
    return ExpertLoad(steps=[offset + s for (s, _), _ in complete], from_steps=[offset + f for (_, f), _ in complete],
                      counts=counts)


def _newest_state(run: Path) -> dict:
    """trainer_state.json of the newest published checkpoint that has a readable one."""
    for info in reversed(list_checkpoints(run)):
        try:
            return read_trainer_state(info.path)
        except CheckpointError:
            continue
    return {}


def _configured_stage(run: Path) -> str | None:
    """The stage named by the config the trainer saved at launch (before any checkpoint exists)."""
    try:
        return json.loads((run / "config.json").read_text(encoding="utf-8")).get("stage")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def read_stage(run: Path, offset: int) -> StageSeries:
    check_run_dir(run)
    header, rows = _rows(run / METRICS_FILE)
    state = _newest_state(run)
    stage = state.get("stage") or _configured_stage(run) or run.name
    series = StageSeries(run_dir=run, stage=str(stage), offset=offset,
                         newest_checkpoint=state.get("step"), total_steps=state.get("total_steps"))
    for column in COLUMNS:
        series.recorded[column] = column in header
        pairs = [(int(r["step"]), _float(r.get(column))) for r in rows if r.get("step", "").isdigit()]
        known = [(s, v) for s, v in pairs if v is not None]
        series.steps[column] = [offset + s for s, _ in known]
        series.values[column] = [v for _, v in known]
    steps = [int(r["step"]) for r in rows if r.get("step", "").isdigit()]
    series.last_step = max(steps + [series.newest_checkpoint or 0])
    series.expert_load = read_expert_load(run / EXPERT_LOAD_FILE, offset)
    return series


def read_stages(runs: list[Path]) -> list[StageSeries]:
    """Every run checked first (nothing is read into a report from a wrong folder), then laid end to end."""
    for run in runs:
        check_run_dir(run)
    out: list[StageSeries] = []
    offset = 0
    for run in runs:
        series = read_stage(run, offset)
        out.append(series)
        offset = series.end
    return out


def smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average with start-up bias correction (a flat series stays flat)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out
