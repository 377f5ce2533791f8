"""`ds-trhash demo`: the whole three-stage pipeline on the tiny preset, on CPU, through the
`deepspeed` launcher, on text that ships with Python. Nothing is downloaded.

Each stage is a separate `deepspeed launch/train.py` launch, exactly as a user would run it,
chained by weights-only initialisation: pretraining → refinement (same unique corpus, fresh
optimizer) → SFT (--source-stage refinement).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ds_trhash.checkpoints import find_resumable
from ds_trhash.training.launch.command import REPO, deepspeed_command



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
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    stages = [
        ("pretraining", "pretrain.yaml", "tiny-pretrain", []),
        ("refinement", "refine.yaml", "tiny-refine", ["--init-checkpoint", "{prev}"]),
        ("supervised-finetuning", "sft.yaml", "tiny-sft", ["--init-checkpoint", "{prev}", "--source-stage", "refinement"]),
    ]
    summary = []
    prev: Path | None = None
    for stage, config, name, extra in stages:
        out = root / name
        if out.exists():
            shutil.rmtree(out)
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


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the tiny three-stage pipeline on CPU through the deepspeed launcher")
    p.add_argument("--root", default="runs/demo", help="where the stages write (default runs/demo)")
    p.add_argument("--nproc", type=int, default=1, help="processes per stage (default 1)")
    p.add_argument("--configs", default=str(REPO / "ds_configs" / "tiny"), help="folder with pretrain/refine/sft.yaml")
    p.set_defaults(func=lambda a: run_demo(Path(a.root).resolve(), a.nproc, Path(a.configs)))
