"""What DeepSpeed's TensorBoard monitor costs a training run (not a test).

    .venv/bin/python bench/bench_monitor_overhead.py [--config ds_configs/tiny/pretrain.yaml] [--steps 40] [--pairs 2]

Runs the same launch (one process, ``launch/train.py``, every step logged so the monitor writes
at every step: the worst case) without and with ``deepspeed.tensorboard.enabled``, each once
with ``--short`` and once with ``--steps`` steps: steps/s = (steps - short) / (wall(steps) -
wall(short)), so start-up (imports, DeepSpeed init, the demo corpus) cancels and what the monitor
adds per step (the events of every row, expert-load counting) stays. Variants alternate,
``--pairs`` times, to spread the machine's background load over both. Also prints the median
``step_time`` (the engine step alone, which the monitor does not touch). Prints what it measured.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ds_trhash.deepspeed_command import free_port

REPO = Path(__file__).resolve().parents[1]


def run_once(config: str, steps: int, out: Path, tensorboard: bool) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, str(REPO / "launch" / "train.py"), "--config", config, "--output-dir", str(out),
           "--max-steps", str(steps), "--set", "training.log_every=1", "--set", "checkpoint.packs=null",
           "--set", "checkpoint.every_steps=null", "--set", "checkpoint.keep_last=1"]
    if tensorboard:
        cmd += ["--set", "deepspeed.tensorboard.enabled=true"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    with open(out / "metrics.csv", newline="") as f:
        times = [float(r["step_time"]) for r in csv.DictReader(f) if r["step_time"]][1:]
    events = list((out / "monitors").rglob("events.out.tfevents.*")) if tensorboard else []
    return {"tensorboard": tensorboard, "median_step_s": statistics.median(times), "steps": len(times) + 1,
            "wall_s": wall, "event_files": len(events)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_configs/tiny/pretrain.yaml")
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--short", type=int, default=10)
    p.add_argument("--pairs", type=int, default=2)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for tb in (False, True):
                short = run_once(args.config, args.short, Path(tmp) / f"s{i}-{int(tb)}", tb)
                long = run_once(args.config, args.steps, Path(tmp) / f"l{i}-{int(tb)}", tb)
                rate = (args.steps - args.short) / (long["wall_s"] - short["wall_s"])
                rows.append({"tensorboard": tb, "steps_per_s": rate, "median_step_s": long["median_step_s"],
                             "event_files": long["event_files"]})
                print(rows[-1], flush=True)
    print(f"\n{args.config}, {args.steps} - {args.short} steps, one process, every step logged, {args.pairs} pair(s)")
    rate = {}
    for tb in (False, True):
        mine = [r for r in rows if r["tensorboard"] == tb]
        rate[tb] = statistics.median(r["steps_per_s"] for r in mine)
        step = statistics.median(r["median_step_s"] for r in mine)
        print(f"  tensorboard {'on ' if tb else 'off'}: {rate[tb]:.2f} steps/s (median engine step {step * 1000:.1f} ms)")
    print(f"  monitor overhead: {100 * (rate[False] / rate[True] - 1):+.1f} % time per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
