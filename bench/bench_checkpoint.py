"""Training-thread time of a checkpoint save: written on the step vs written in the background.

A DeepSpeed engine (one process, the trainer's ``build_engine`` path of deepspeed.initialize)
over a stack of linear layers holding ``--params`` parameters takes one optimizer step, so the
optimizer holds its moments, then saves it ``--repeats`` times each way into a scratch
directory:

* ``sync``: ``checkpoints.save_checkpoint`` around ``engine.save_checkpoint`` (what every save
  cost before): DeepSpeed's torch.save, fsync, SHA-256 of every file, publish;
* ``background``: ``checkpoints.background.BackgroundSaver`` with the capturing checkpoint
  engine (what the trainer does now): the training thread's part (``start``), then the rest in
  the thread until the checkpoint is published (``wait``).

Per mode: the state's bytes on disk, the median training-thread seconds and the median seconds
until the checkpoint is complete, and each projected linearly to ``--project-gb`` (2.7 GB: the
200m state of weights, fp32 master and Adam moments). bf16 with ZeRO 1 on CUDA (weights 2 +
master 4 + moments 8 bytes a parameter), fp32 without ZeRO on CPU (4 + 8).
``.venv/bin/python bench/bench_checkpoint.py --params 25e6`` (CPU: about 300 MB);
on an H200: ``python bench/bench_checkpoint.py --params 193e6 --json bench/results/checkpoint.json``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _engine(params: float, device: torch.device):
    import deepspeed

    width = 2048
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    cuda = device.type == "cuda"
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": cuda}, "zero_optimization": {"stage": 1 if cuda else 0},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    x = torch.randn(4, width, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return engine, layers * width * width


def _state(step: int) -> dict:
    return {"stage": "pretraining", "step": step, "epoch": 0, "data_cursor": step, "world_size": 1,
            "training_critical": {}, "plan_fingerprint": None, "plan_sha256": None, "backends_used": {},
            "lora": False, "family": "language", "framework_commit": "bench"}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(engine, out: Path, repeats: int) -> dict:
    from ds_trhash import checkpoints as ckpt
    from ds_trhash.checkpoints.background import BackgroundSaver
    from ds_trhash.checkpoints.save import save_checkpoint
    from ds_trhash.training.checkpoint_capture import capturing

    sync_on_step, bg_on_step, bg_complete, size = [], [], [], 0
    for i in range(repeats):
        t0 = time.perf_counter()
        path = save_checkpoint(out, 2 * i + 1, write_engine_state=lambda tmp: engine.save_checkpoint(
            str(tmp), tag=ckpt.ENGINE_TAG), trainer_state=_state(2 * i + 1), rank=0, world_size=1)
        sync_on_step.append(time.perf_counter() - t0)
        size = _size(path)
        shutil.rmtree(path)
    capture = capturing(engine)
    saver = BackgroundSaver(0, 1)
    for i in range(repeats):
        step = 2 * i + 2

        def take(tmp):
            engine.save_checkpoint(str(tmp), tag=ckpt.ENGINE_TAG)
            return capture.take()

        t0 = time.perf_counter()
        saver.start(out, step, capture=take, trainer_state=_state(step))
        bg_on_step.append(time.perf_counter() - t0)
        done = saver.wait()
        bg_complete.append(time.perf_counter() - t0)
        assert ckpt.verify(done.path)[0]
        shutil.rmtree(done.path)
    med = statistics.median
    return {"bytes": size, "sync_on_step_s": med(sync_on_step), "background_on_step_s": med(bg_on_step),
            "background_complete_s": med(bg_complete), "runs": {"sync": sync_on_step, "background_on_step": bg_on_step,
                                                                "background_complete": bg_complete}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=25e6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--project-gb", type=float, default=2.7)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from ds_trhash.training.engine import init_distributed

    init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    engine, n = _engine(args.params, device)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        result = measure(engine, scratch, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    scale = args.project_gb * 1e9 / result["bytes"]
    result.update(device=str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), params=n,
                  projected_gb=args.project_gb,
                  **{f"{k}_projected": result[k] * scale for k in ("sync_on_step_s", "background_on_step_s",
                                                                   "background_complete_s")})
    print(f"state {result['bytes'] / 1e6:.0f} MB ({n / 1e6:.0f}M params) on {result['device']}, median of {args.repeats}")
    for key, label in (("sync_on_step_s", "sync save, on the step"), ("background_on_step_s",
                       "background save, on the step"), ("background_complete_s", "background save, until complete")):
        print(f"  {label:34s} {result[key]:7.3f} s   -> {result[key + '_projected']:6.2f} s at {args.project_gb} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
