"""Checkpoint selection: which epoch checkpoint becomes ``best/``, and why.

Held-out loss and downstream quality measure different things (docs/contracts.md §8), so the rule is part
of the record: ``selection.json`` names it and lists every candidate's metrics, and ``best/``
is replaced atomically after each epoch so a crash never leaves a half-copied best.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ds_trhash.io import publish_dir, write_json_atomic

RULES = ("min_eval_loss", "last")


@dataclass(frozen=True)
class Candidate:
    epoch: int | None  # None: a run record's checkpoint entry that names no epoch
    step: int
    checkpoint: str
    eval_loss: float | None
    eval_ppl: float | None
    eval_tokens: int | None
    train_loss: float | None
    piqa_acc: float | None = None  # reported beside the loss: the two measure different things
    piqa_acc_norm: float | None = None


def choose(candidates: list[Candidate], rule: str) -> Candidate:
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; allowed: {', '.join(RULES)}")
    if not candidates:
        raise ValueError("no candidate checkpoints to select from")
    if rule == "last":
        return max(candidates, key=lambda c: c.step)
    scored = [c for c in candidates if c.eval_loss is not None]
    if not scored:
        raise ValueError("rule min_eval_loss needs held-out results; enable eval.heldout or use eval.select=last")
    # ties go to the earlier checkpoint: fewer steps for the same held-out loss
    return min(scored, key=lambda c: (c.eval_loss, c.step))


def _link_or_copy_tree(src: Path, dst: Path) -> None:
    """Hard links where the filesystem allows (checkpoints are large and immutable), else copies."""
    for root, _, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(root) / name, dst / rel / name)
            except OSError:
                shutil.copy2(Path(root) / name, dst / rel / name)


def publish(output_dir: Path, candidates: list[Candidate], rule: str) -> Candidate:
    """Write ``best/`` and ``selection.json`` for the current candidates (rank 0 only)."""
    winner = choose(candidates, rule)
    best, tmp = output_dir / "best", output_dir / "best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _link_or_copy_tree(Path(winner.checkpoint), tmp)
    publish_dir(tmp, best, fsync=False)
    doc = {
        "rule": rule,
        "selected": asdict(winner),
        "candidates": [asdict(c) for c in sorted(candidates, key=lambda c: c.step)],
        "note": "held-out loss and downstream benchmarks measure different properties; report both",
    }
    write_json_atomic(output_dir / "selection.json", doc, fsync=False)
    return winner
