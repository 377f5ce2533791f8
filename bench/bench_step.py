"""Time one full optimizer step (forward + backward + optimizer) of a TR-HASH model, per training path.

GPU run (the numbers that count; H200, torch 2.11):

    python bench/bench_step.py --json runs/bench_step.json
    # = --device cuda --preset 200m --seq-len 2048 --micro-batch 16 --grad-accum 1 --precision bf16

CPU smoke run (checks that every code path runs; the figures mean nothing):

    python bench/bench_step.py --device cpu --preset tiny --seq-len 64 --micro-batch 2 \
        --steps 2 --precision fp32 --json /tmp/bench_step.json

Cases (``--cases``, comma separated, run in the order given; default all, in the order below).
Each case runs in a process of its own (bench/step_child.py), so a case that crashes, hangs or
corrupts the CUDA context (an illegal memory access) is recorded with its error -- type, message,
the last lines of its output -- and the next case runs on a clean device.

compile_masked  THE ANCHOR: every ratio in the report is against this case of the same run. What a
                user writes in plain PyTorch, as ../shared/bench/ref_step.py did in November
                (248,155 tokens/s, 26.4 GiB on an H200): our model at the preset with its routed
                experts computed masked (every expert on every token, weighted by the route
                mask; bench/step_cases.py swaps each MoE block's forward for that), PyTorch
                norm/RoPE, the plain full-logits loss, fp32 weights under
                ``torch.autocast(bf16)``, ``torch.compile(model)``, ``torch.optim.AdamW(fused=True)``
                on the fp32 weights, clipping at the config's grad_clip (ref_step.py does not clip).
                The model runs under autocast: norms keep fp32 statistics, the routed-expert op
                casts to the autocast dtype itself (ds_trhash.model.autocast), the losses take
                fp32 logits (tests/model/test_autocast.py).
compile         the model's own PyTorch paths (gathered experts, chunked CE), weights in the run
                dtype (``model.to(bf16)``), ``torch.compile(model)``, fused AdamW straight on those
                weights, clipping. No master weights.
eager           the same without torch.compile.
manual          a hand-written loop doing what the engine does, minus DeepSpeed: the kernel
                choice of the engine (``backend.resolve`` + ``backend.apply``), weights in the
                run dtype, fp32 master weights and fp32 AdamW state (``fused=True``), grads
                copied to fp32, clipping, weights copied back. The like-for-like baseline for
                the engine's own cost (``overhead_vs_manual``).
engine          the project's path: ``engine.build_engine`` on a TrainConfig from ``--config``
                (default ``ds_configs/200m/pretrain.yaml``) with micro batch / seq len /
                precision / grad accum from the command line, ZeRO ``--zero`` (1), the config's
                kernels policy (auto: Triton experts + Liger loss/norm/RoPE on CUDA) and
                ``deepspeed:`` section; steps through ``ds_trhash.training.loop.train_step``.
engine_compile  the engine path with ``kernels.compile: layers`` (each decoder layer compiled).
engine_compile_model  the same with ``kernels.compile: model``.

Every case builds its model as the trainer does, with the config's
``model.activation_checkpointing`` applied (``--activation-checkpointing`` overrides it); the
layers it recomputes are recorded per case. ``--set KEY=VALUE`` overrides the config as a launch's
``--set`` does (e.g. ``deepspeed.wall_clock_breakdown=true`` to measure a DeepSpeed setting).

Per case: ``--warmup`` untimed steps (compilation, Triton autotuning), then ``--steps`` timed
steps, each between two ``torch.cuda.synchronize()``; median step time, tokens/s, model
TFLOP/s, MFU, peak memory (``torch.cuda.max_memory_allocated`` of the case's process; the memory
allocated when the timed case starts is printed beside it), and ``backends_used()`` of the model.

FLOPs: training FLOPs per token are counted as 1.35e9 for the 200m preset at sequence 2,048
(6 x 195.7 M matmul parameters active per token, head included, + 6 x 16 layers x 2,048 x 896
for causal attention scores and values). Other shapes use that same formula
(``train_flops_per_token``); ``--flops-per-token`` overrides. MFU is against a bf16 peak measured
in the same run (an 8192^3 bf16 matmul; about 790 TFLOP/s on an H200) and the nominal peak.

Exit status: 0 when every requested case ran or was skipped, 1 when one failed (table and
JSON are written first), 2 when the requested device is missing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the step_* modules beside this script

from step_cases import Ctx, build_anchor, build_engine_case, build_manual, build_plain, checkpointed  # noqa: E402
from step_child import run_child  # noqa: E402
from step_measure import (  # noqa: E402
    flops_per_token, free_memory, git_rev, is_oom, measure_matmul_peak, nominal_peak,
    profile_step, sync, versions,
)
from step_report import ANCHOR_CASE, ENGINE_CASES, TARGETS, comparisons, derive, print_report, targets  # noqa: E402

from ds_trhash.model.flops import train_flops_per_token  # noqa: E402,F401 -- the tests read it from here

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "ds_configs" / "200m" / "pretrain.yaml"

#: Default order: the anchor first, then the project's path and its like-for-like baseline, the
#: slow-to-compile engine cases, and the older plain baselines last.
CASES = (ANCHOR_CASE, "engine", "manual", "engine_compile", "engine_compile_model", "compile", "eager")
LABELS = {
    ANCHOR_CASE: "ANCHOR: plain PyTorch, masked experts, autocast, torch.compile",
    "compile": "plain PyTorch, gathered experts, torch.compile",
    "eager": "plain PyTorch, gathered experts, eager",
    "manual": "plain loop, engine kernels + fp32 master",
    "engine": "DeepSpeed engine (project path)",
    "engine_compile": "engine, kernels.compile=layers",
    "engine_compile_model": "engine, kernels.compile=model",
}
COMPILE_CASES = (ANCHOR_CASE, "compile", "engine_compile", "engine_compile_model")

#: Earlier measurements of plain PyTorch (H200, torch 2.11), for the record only: the ratios are
#: against the anchor case measured in the same run.
HISTORY = {"ref_step.py compile_masked, November": {"tokens_per_s": 248_155, "peak_gib": 26.4}}
GIB = 2**30


# ----------------------------------------------------------------------------- one case


def build_case(name: str, ctx: Ctx, holder: dict):
    if name == ANCHOR_CASE:
        return build_anchor(ctx, holder)
    if name in ("eager", "compile"):
        return build_plain(ctx, name == "compile", holder)
    if name == "manual":
        return build_manual(ctx, holder)
    return build_engine_case(ctx, ENGINE_CASES[name], holder)


def _time_steps(step, args, device: torch.device, res: dict) -> list:
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step())
    sync(device)
    res["warmup_s"] = time.perf_counter() - t0
    if device.type == "cuda":
        res["mem_before_gib"] = torch.cuda.memory_allocated(device) / GIB
    times = []
    for _ in range(args.steps):
        sync(device)
        t = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t)
    res["step_s"] = times
    res["step_s_median"] = statistics.median(times)
    res["losses"] = [float(x) for x in losses]
    return losses


def skip_reason(name: str, args) -> str | None:
    if name in COMPILE_CASES and args.device == "cpu" and not args.cpu_compile:
        return "torch.compile is not run on CPU unless --cpu-compile"
    return None


def run_case(name: str, ctx: Ctx, tokens_per_step: int, on_result=None) -> dict:
    """Build and time case ``name``; ``on_result(res)`` is called before anything is freed (a
    child writes its JSON there, so a crash in the cleanup loses nothing)."""
    args, device = ctx.args, ctx.device
    res: dict = {"case": name, "label": LABELS[name], "status": "ok"}
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    holder: dict = {}
    try:
        from torch._dynamo.utils import counters

        from ds_trhash.model import backend

        counters.clear()  # graph-break counts of this case only
        t0 = time.perf_counter()
        step, info = build_case(name, ctx, holder)
        res.update(info)
        res["build_s"] = time.perf_counter() - t0
        res["checkpointed_layers"] = checkpointed(holder["model"])
        _time_steps(step, args, device, res)
        if args.profile:
            res["profile"] = profile_step(step, args, device, name)
        res["backends"] = backend.recorded_backends(holder["model"])
        res["tokens_per_s"] = tokens_per_step / res["step_s_median"]
        if device.type == "cuda":
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            res["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        if name in COMPILE_CASES:
            res["graph_breaks"] = int(sum(counters["graph_break"].values()))
    except Exception as exc:  # OOM or anything else: report this case, run the next one
        res["status"] = "oom" if is_oom(exc) else "error"
        res["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        res["traceback"] = traceback.format_exc()[-4000:]
        if device.type == "cuda":
            try:
                res["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            except Exception:  # noqa: BLE001 -- a poisoned context raises here too
                pass
    if on_result is not None:
        on_result(res)
    holder.clear()
    step = info = None  # noqa: F841 - drop the closures holding model and optimizer
    free_memory(device)
    return res


def child_main(args) -> int:
    """A child process: one case, its result written to --child-result, then out at once (the
    process group, a poisoned CUDA context, compiled graphs are not torn down one by one)."""
    device = setup(args)
    ctx = Ctx(args, device)
    out = Path(args.child_result)

    def write(res: dict) -> None:
        out.write_text(json.dumps(res, default=str))

    res = run_case(args.case_list[0], ctx, tokens_per_step(args), on_result=write)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if res["status"] == "ok" else 1)


def child_command(args, name: str, result: Path) -> list[str]:
    """This script's command line for one case in a child process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-result", str(result), "--cases", name]
    for flag in ("device", "preset", "seq_len", "micro_batch", "grad_accum", "precision", "steps", "warmup",
                 "config", "zero", "kernels_policy", "activation_checkpointing", "threads", "profile", "profile_dir"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    for item in args.set:
        cmd += ["--set", item]
    return cmd + (["--cpu-compile"] if args.cpu_compile else [])


def run_isolated(name: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        result = Path(tmp) / f"{name}.json"
        res = run_child(child_command(args, name, result), result, args.case_timeout, name)
    res.setdefault("label", LABELS[name])
    return res


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--preset", choices=("200m", "tiny"), default="200m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per case (3 on CUDA, 1 on CPU)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma separated, from {','.join(CASES)}")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config every case is built from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field, as for a launch (repeatable)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2), default=1)
    ap.add_argument("--kernels-policy", choices=("auto", "triton", "pytorch"), default=None,
                    help="override kernels.policy of the config (default: the config's, auto)")
    ap.add_argument("--activation-checkpointing", choices=("none", "full", "every_n"), default=None,
                    help="override model.activation_checkpointing of the config")
    ap.add_argument("--peak-size", type=int, default=None, help="matmul size for the measured peak "
                    "(8192 on CUDA, 512 on CPU)")
    ap.add_argument("--nominal-tflops", type=float, default=None, help="nominal peak, if the device is not known")
    ap.add_argument("--flops-per-token", type=float, default=None)
    ap.add_argument("--cpu-compile", action="store_true", help="run the compile cases on CPU too")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--case-timeout", type=float, default=None,
                    help="seconds one case may run, build included (240 on CUDA, 900 on CPU)")
    ap.add_argument("--in-process", action="store_true", help="run every case in this process (no isolation)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one more step per case and record its N costliest ops (self time)")
    ap.add_argument("--profile-dir", default=None, help="with --profile: write each case's Chrome trace here")
    ap.add_argument("--json", default=None, help="write the full report here")
    ap.add_argument("--child-result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        ap.error(f"--cases: unknown {unknown}; allowed: {','.join(CASES)}")
    args.case_list = cases
    if args.warmup is None:
        args.warmup = 3 if args.device == "cuda" else 1
    if args.case_timeout is None:
        args.case_timeout = 240.0 if args.device == "cuda" else 900.0
    if args.steps < 1 or args.warmup < 0 or args.grad_accum < 1:
        ap.error("--steps and --grad-accum must be >= 1 and --warmup >= 0")
    return args


def tokens_per_step(args) -> int:
    return args.grad_accum * args.micro_batch * args.seq_len


def setup(args) -> torch.device:
    """Threads, logging and (for the engine cases) the one-process group of this process."""
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if any(c in ENGINE_CASES for c in args.case_list):
        from ds_trhash.training.engine import init_distributed

        init_distributed()  # RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* default to one local process
        try:
            from deepspeed.utils import logger as ds_logger

            ds_logger.setLevel(logging.WARNING)
        except ImportError:  # pragma: no cover
            pass
    # TF32 stays at torch's default (off), as in the trainer.
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def build_meta(args, ctx: Ctx, device: torch.device) -> dict:
    fpt, fpt_source = flops_per_token(args.preset, ctx.model_cfg, args.seq_len, args.flops_per_token)
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = measure_matmul_peak(device, args.peak_size or (8192 if device.type == "cuda" else 512), peak_dtype)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_rev": git_rev(), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": versions(), "preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum, "precision": args.precision, "zero": args.zero, "warmup": args.warmup,
        "steps": args.steps, "tokens_per_step": tokens_per_step(args), "flops_per_token": fpt,
        "flops_source": fpt_source, "matmul_peak": peak, "nominal_tflops": nominal_peak(device, args.nominal_tflops),
        "config": str(args.config), "overrides": list(args.set), "kernels_policy": ctx.train_cfg.kernels.policy,
        "activation_checkpointing": ctx.train_cfg.model.activation_checkpointing, "cases": args.case_list,
        "anchor_case": ANCHOR_CASE, "history": HISTORY, "targets": TARGETS,
        "isolated": not args.in_process,
    }
    meta["reference_shape"] = (device.type == "cuda" and args.preset == "200m" and args.seq_len == 2048
                               and args.micro_batch == 16 and args.precision == "bf16" and args.grad_accum == 1)
    return meta


def report_of(meta: dict, results: dict) -> dict:
    derive(results, meta["matmul_peak"], meta["nominal_tflops"], meta["flops_per_token"])
    comps = comparisons(results)
    return {"meta": meta, "cases": results, "comparisons": comps,
            "targets": targets(results, comps, meta["reference_shape"])}


def run_all(args, ctx: Ctx, meta: dict, write_json) -> dict:
    results: dict = {}
    for name in args.case_list:
        print(f"[bench_step] {name}: {LABELS[name]} ...", flush=True)
        reason = skip_reason(name, args)
        if reason:
            results[name] = {"case": name, "label": LABELS[name], "status": "skipped", "reason": reason}
        elif args.in_process:
            results[name] = run_case(name, ctx, meta["tokens_per_step"])
        else:
            results[name] = run_isolated(name, args)
        r = results[name]
        if r["status"] == "ok":
            print(f"[bench_step] {name}: {r['step_s_median'] * 1e3:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s",
                  flush=True)
        else:
            print(f"[bench_step] {name}: {r['status']} {r.get('reason') or r.get('error', '')[:300]}", flush=True)
        write_json(report_of(meta, results))  # partial results survive a run cut short
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_step: --device cuda but no CUDA device here; for the CPU smoke run use "
              "--device cpu --preset tiny --seq-len 64 --micro-batch 2 --steps 2 --precision fp32",
              file=sys.stderr)
        return 2
    if args.child_result:
        return child_main(args)
    # a `timeout` around the bench sends SIGTERM: exit through the case runner, which kills its child
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.in_process:
        args_parent = argparse.Namespace(**{**vars(args), "case_list": []})  # no process group here
        device = setup(args_parent)
    else:
        device = setup(args)
    ctx = Ctx(args, device)
    meta = build_meta(args, ctx, device)

    def write_json(report: dict) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))

    results = run_all(args, ctx, meta, write_json)
    report = report_of(meta, results)
    print_report(report)
    write_json(report)
    if args.json:
        print(f"\nwrote {args.json}")
    return 1 if any(r["status"] not in ("ok", "skipped") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
