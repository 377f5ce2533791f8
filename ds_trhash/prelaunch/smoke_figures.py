"""The figures of a smoke run, read from what the launches left on disk, and the projection of
the full run from them. Pure functions over files: the arithmetic can be checked on its own.
"""
from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ds_trhash.errors import UserError



class FiguresError(UserError, RuntimeError):
    """A launch left no usable record of what it measured."""


def step_seconds(metrics_csv: Path) -> list[tuple[int, float, int]]:
    """(step, seconds, tokens) per logged step: the loop's own ``step_time`` and the growth of
    ``tokens_seen``; every step must be logged (log_every 1)."""
    with open(metrics_csv, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("step_time")]
    out, seen = [], 0
    for r in rows:
        step, tokens_seen, seconds = int(r["step"]), int(r["tokens_seen"]), float(r["step_time"])
        tokens, seen = tokens_seen - seen, tokens_seen
        if seconds > 0 and tokens > 0:
            out.append((step, seconds, tokens))
    if not out:
        raise FiguresError(f"{metrics_csv} holds no timed step")
    return out


def typical_step(timed: list[tuple[int, float, int]]) -> tuple[float, int, str]:
    """(median seconds per step, tokens per step, which steps): the first step is left out when
    there are others, since it pays for warm-up (allocator, kernel selection, caches)."""
    steady = timed[1:] if len(timed) > 1 else timed
    first, last = steady[0][0], steady[-1][0]
    return (statistics.median(s for _, s, _ in steady), steady[-1][2],
            f"median of steps {first}-{last}" if first != last else f"step {first}")


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def save_seconds(ckpt_dir: Path) -> float:
    """From the trainer's note of when the save began to the manifest, written last."""
    state = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text(encoding="utf-8"))
    started = state.get("save_started_unix")
    if started is None:
        raise FiguresError(f"{ckpt_dir}/trainer_state.json records no save_started_unix")
    return max(0.0, (Path(ckpt_dir) / "MANIFEST.json").stat().st_mtime - float(started))


def peak_memory(ckpt_dir: Path) -> tuple[int, str]:
    state = json.loads((Path(ckpt_dir) / "trainer_state.json").read_text(encoding="utf-8"))
    peak = state.get("peak_memory") or {}
    if not peak.get("bytes"):
        raise FiguresError(f"{ckpt_dir}/trainer_state.json records no peak_memory")
    return int(peak["bytes"]), str(peak.get("kind"))


@dataclass(frozen=True)
class Projection:
    """The full run at the smoke's pace: steps x step time plus every save x save time, and the
    checkpoints it keeps at once x checkpoint size."""

    total_steps: int
    step_seconds: float
    saves: int
    save_seconds: float
    kept_checkpoints: int
    checkpoint_bytes: int

    @property
    def wall_seconds(self) -> float:
        return self.total_steps * self.step_seconds + self.saves * self.save_seconds

    @property
    def disk_bytes(self) -> int:
        return self.kept_checkpoints * self.checkpoint_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "wall_seconds": self.wall_seconds, "disk_bytes": self.disk_bytes}
