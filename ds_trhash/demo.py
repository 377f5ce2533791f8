"""`ds-trhash demo`: the whole three-stage pipeline on the tiny preset, on CPU, through the
`deepspeed` launcher, on text that ships with Python. Nothing is downloaded.

Each stage is a separate `deepspeed launch/train.py` launch, exactly as a user would run it,
chained by weights-only initialisation: pretraining → refinement (same unique corpus, fresh
optimizer) → SFT (--source-stage refinement).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ds_trhash import outputs
from ds_trhash.argtypes import positive_int
from ds_trhash.checkpoints import find_resumable
from ds_trhash.errors import UserError
from ds_trhash.deepspeed_command import REPO, deepspeed_command

# Written into each stage directory the demo creates: only such a directory (or an empty one) is
# ever cleared by a later demo; anything else under --root was made by someone else.
DEMO_MARK = ".ds-trhash-demo"
STAGES = [
    ("pretraining", "pretrain.yaml", "tiny-pretrain", []),
    ("refinement", "refine.yaml", "tiny-refine", ["--init-checkpoint", "{prev}"]),
    ("supervised-finetuning", "sft.yaml", "tiny-sft", ["--init-checkpoint", "{prev}", "--source-stage", "refinement"]),
]


class DemoError(UserError, ValueError):
    """A demo that cannot start without touching what it did not make."""


def check_demo_targets(root: Path, configs: Path) -> None:
    """Before any stage runs: every stage config exists, and every stage directory is new, empty,
    or one an earlier demo made (it is then replaced). Nothing else is ever deleted."""
    missing = [config for _, config, _, _ in STAGES if not (configs / config).is_file()]
    if missing:
        raise DemoError(f"--configs {configs} lacks {', '.join(missing)}; point --configs at a folder with "
                        "pretrain.yaml, refine.yaml and sft.yaml")
    outputs.check_dir_target("--root", root)
    for _, _, name, _ in STAGES:
        out = root / name
        outputs.refuse_unless_ours(f"--root {root}: the stage directory", out, (out / DEMO_MARK).is_file(),
                                   "ds-trhash demo")



def column(metrics_csv: Path, name: str) -> list[float]:
    with open(metrics_csv, newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r.get(name)]


def loss_range(metrics_csv: Path) -> tuple[float, float, int]:
    """(first, last, rows) of the train_loss column."""
    losses = column(metrics_csv, "train_loss")
    if not losses:
        raise RuntimeError(f"{metrics_csv} holds no training loss")
    return losses[0], losses[-1], len(losses)


def latest_checkpoint(output_dir: Path) -> Path:
    info = find_resumable(output_dir, log=lambda *_: None)
    if info is None:
        raise RuntimeError(f"no complete checkpoint in {output_dir}")
    return Path(info.path)


def run_demo(root: Path, nproc: int, configs: Path) -> int:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    check_demo_targets(root, configs)
    summary = []
    prev: Path | None = None
    for stage, config, name, extra in STAGES:
        out = root / name
        if out.exists():  # an earlier demo's (check_demo_targets) or empty
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / DEMO_MARK).write_text("made by ds-trhash demo; a later demo replaces this directory\n")
        args = [a.replace("{prev}", str(prev)) for a in extra] + ["--output-dir", str(out)]
        cmd = deepspeed_command(str(configs / config), nproc, args)
        print(f"\n=== {stage}: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, env=env, cwd=REPO)
        if rc != 0:
            print(f"demo: the {stage} stage failed (exit {rc})", file=sys.stderr)
            return rc
        first, last, rows = loss_range(out / "metrics.csv")
        summary.append((stage, first, last, rows, column(out / "metrics.csv", "eval_loss")))
        prev = latest_checkpoint(out)
    print("\n=== demo summary (train loss, first → last logged step)")
    for stage, first, last, rows, evals in summary:
        print(f"{stage:>22}: {first:.4f} → {last:.4f}  over {rows} logged steps")
        if evals:
            print(f"{'held-out':>22}: " + " → ".join(f"{e:.4f}" for e in evals)
                  + "  (source checkpoint, then each epoch)")
    print(f"outputs under {root}; the SFT result is {root}/tiny-sft/best")
    print(f"export with:   ds-trhash export --checkpoint {root}/tiny-sft/best --out <dir>")
    print(f"generate with: ds-trhash generate --model {root}/tiny-sft/best --chat \"What does the Python "
          f"reference say about the for statement?\"")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the tiny three-stage pipeline on CPU through the deepspeed launcher")
    p.add_argument("--root", default="runs/demo", help="where the stages write (default runs/demo)")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes per stage (default 1)")
    p.add_argument("--configs", default=str(REPO / "ds_configs" / "tiny"), help="folder with pretrain/refine/sft.yaml")
    p.set_defaults(func=lambda a: run_demo(Path(a.root).resolve(), a.nproc, Path(a.configs)))
    outputs.writes_dirs(p, "--root")
