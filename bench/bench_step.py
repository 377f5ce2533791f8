"""Time one full optimizer step (forward + backward + optimizer) of a TR-HASH model, per training path.

GPU run (the numbers that count; H200, torch 2.11, one process):

    python bench/bench_step.py --json runs/bench_step.json
    # = --device cuda --preset 200m --seq-len 2048 --micro-batch 16 --precision bf16

CPU smoke run (checks that every code path runs; the figures mean nothing):

    python bench/bench_step.py --device cpu --preset tiny --seq-len 64 --micro-batch 2 \
        --steps 2 --precision fp32 --json /tmp/bench_step.json

Cases (``--cases``, comma separated, run in the order given, all in this one process; the
default order is engine, manual, compile, eager, engine_compile, engine_compile_model):

eager           what a user writes with plain PyTorch: the model with its default backends
                (PyTorch experts, chunked CE, PyTorch norm/RoPE), weights in the run dtype
                (``model.to(torch.bfloat16)``: the model cannot run under ``torch.autocast``,
                see below), ``torch.optim.AdamW(fused=True)`` straight on those weights, grad
                clipping at 1.0, ``zero_grad(set_to_none=True)``. No master weights.
compile         the same loop with ``torch.compile(model)`` (default mode; the optimizer is not
                compiled). The anchor of the speed issue: H200 / torch 2.11 measured 248,155
                tokens/s, 42.4 % MFU, 26.4 GiB peak (eager: 112,516 tokens/s, 51.4 GiB).
manual          a hand-written loop doing what the engine does, minus DeepSpeed: the kernel
                choice of the engine (``backend.resolve`` + ``backend.apply``), weights in the
                run dtype, fp32 master weights and fp32 AdamW state (``fused=True``), grads
                copied to fp32, clipping at 1.0, weights copied back. The like-for-like
                baseline for the engine's overhead.
engine          the project's path: ``engine.build_engine`` on a TrainConfig from
                ``ds_configs/200m/pretrain.yaml`` with micro batch / seq len / precision from
                the command line, grad_accum 1, ZeRO ``--zero`` (1), kernels policy from the
                config (auto: Triton experts + Liger loss/norm/RoPE on CUDA when they import);
                steps run through ``ds_trhash.training.loop.train_step``, as the trainer does.
engine_compile  the engine path with ``kernels.compile: layers``, as the trainer builds it: every
                decoder layer compiled in place with inductor (``ds_trhash.model.compile``),
                the routed experts inside the graph as their custom op (Triton on CUDA), Liger
                loss/norm/RoPE kept where the policy chose them.
engine_compile_model  the same with ``kernels.compile: model``: the whole model, loss included,
                one graph.

Per case: ``--warmup`` untimed steps (compilation, Triton autotuning), then ``--steps`` timed
steps, each between two ``torch.cuda.synchronize()``; median step time, tokens/s, model
TFLOP/s, MFU, peak memory (``torch.cuda.max_memory_allocated``, reset at the start of each
case; the memory still allocated when the case starts is printed beside it), and
``backends_used()`` of the model. Each case is built from scratch (same seed, same batch) and
freed afterwards (del, ``torch._dynamo.reset``, gc, ``empty_cache``); an out-of-memory error or
any other failure is reported for that case and the next case runs.

FLOPs: training FLOPs per token are counted as 1.35e9 for the 200m preset at sequence 2,048
(the constant of the speed issue: 6 x 195.7 M matmul parameters active per token, head
included, + 6 x 16 layers x 2,048 x 896 for causal attention scores and values). Other
shapes use that same formula (``train_flops_per_token``); ``--flops-per-token`` overrides.
MFU is against a bf16 peak measured in the same run (an 8192^3 bf16 matmul, median of timed
runs; about 790 TFLOP/s on an H200) and, where known, against the nominal dense bf16 peak.

Exit status: 0 when every requested case ran or was skipped, 1 when one failed (table and
JSON are written first), 2 when the requested device is missing.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from ds_trhash.model.flops import nominal_bf16_tflops, train_flops_per_token  # noqa: F401 -- used below and by tests
from ds_trhash.model.loss import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "ds_configs" / "200m" / "pretrain.yaml"

#: Default order: the project's path first, on a clean allocator and before anything can run
#: out of time; the slow-to-compile cases after the baselines they are compared with.
CASES = ("engine", "manual", "compile", "eager", "engine_compile", "engine_compile_model")
LABELS = {
    "eager": "plain PyTorch, eager",
    "compile": "plain PyTorch, torch.compile",
    "manual": "plain loop, engine kernels + fp32 master",
    "engine": "DeepSpeed engine (project path)",
    "engine_compile": "engine, kernels.compile=layers",
    "engine_compile_model": "engine, kernels.compile=model",
}
#: kernels.compile of each engine case
ENGINE_CASES = {"engine": "none", "engine_compile": "layers", "engine_compile_model": "model"}
COMPILE_CASES = ("compile", "engine_compile", "engine_compile_model")

#: Training FLOPs per token of the 200m preset at sequence 2,048 (the speed issue's constant).
FLOPS_PER_TOKEN_200M_2048 = 1.35e9
#: The compiled anchor of the speed issue (H200, torch 2.11, plain PyTorch + torch.compile).
ANCHOR = {"compile": {"tokens_per_s": 248_155, "mfu": 0.424, "peak_gib": 26.4},
          "eager": {"tokens_per_s": 112_516, "peak_gib": 51.4}}
#: Targets of the project's path (engine cases), judged only at the reference shape on CUDA.
TARGETS = {"tokens_per_s": 300_000, "speedup_vs_compile": 1.2, "peak_gib": 20.0, "engine_overhead": 0.05}
GIB = 2**30


# ----------------------------------------------------------------------------- helpers


def flops_per_token(preset: str, cfg, seq_len: int, override: float | None) -> tuple[float, str]:
    if override is not None:
        return override, "--flops-per-token"
    if preset == "200m" and seq_len == 2048:
        return FLOPS_PER_TOKEN_200M_2048, "constant 1.35e9 (200m at 2,048, speed issue)"
    return train_flops_per_token(cfg, seq_len), "formula 6*active matmul params + 6*L*T*d_attn"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    try:
        torch._dynamo.reset()  # drops compiled graphs and the modules they hold
    except Exception:  # pragma: no cover - dynamo unavailable
        pass
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


def git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "triton", "liger-kernel"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def nominal_peak(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return nominal_bf16_tflops(torch.cuda.get_device_name(device))


def measure_matmul_peak(device: torch.device, size: int, dtype: torch.dtype, iters: int = 10) -> dict:
    """Median TFLOP/s of a size^3 matmul (random data) after 3 warm-ups."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device, dtype)
    b = torch.randn(size, size, generator=gen).to(device, dtype)
    for _ in range(3):
        torch.mm(a, b)
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
    del a, b
    seconds = statistics.median(times)
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "iters": iters,
            "median_s": seconds, "tflops": 2.0 * size**3 / seconds / 1e12}


# ----------------------------------------------------------------------------- the cases


class Ctx:
    """What every case shares: arguments, device, dtype, model config, one fixed batch."""

    def __init__(self, args, device: torch.device):
        import dataclasses

        from ds_trhash.model.config import TRHashConfig
        from ds_trhash.training import config as tcfg

        self.args = args
        self.device = device
        self.dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        overrides = [f"model.preset={args.preset}", f"data.seq_len={args.seq_len}",
                     f"batch.micro_batch={args.micro_batch}", "batch.grad_accum=1", "batch.global_tokens=null",
                     f"zero.stage={args.zero}", f"precision={args.precision}"]
        if args.kernels_policy:
            overrides.append(f"kernels.policy={args.kernels_policy}")
        self.train_cfg = tcfg.load_config(args.config, overrides)
        self.ds_config = tcfg.to_deepspeed_dict(self.train_cfg, 1)
        # As the trainer builds it: the preset, with the loss chunk size of the config.
        self.model_cfg = dataclasses.replace(TRHashConfig.from_preset(args.preset),
                                             loss_chunk_tokens=self.train_cfg.kernels.loss_chunk_tokens)
        if args.seq_len > self.model_cfg.max_seq_len:
            raise SystemExit(f"--seq-len {args.seq_len} exceeds the {args.preset} context "
                             f"{self.model_cfg.max_seq_len}")
        gen = torch.Generator(device="cpu").manual_seed(1234)
        ids = torch.randint(0, self.model_cfg.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]  # next-token targets, the last position unsupervised
        self.cpu_batch = {"input_ids": ids, "labels": labels}  # what the trainer's loop receives
        self.ids, self.labels = ids.to(device), labels.to(device)

    def new_model(self):
        """A fresh model on CPU with the run's seed (the trainer's build order), default backends."""
        from ds_trhash.model import TRHashForCausalLM

        torch.manual_seed(self.train_cfg.seed)
        return TRHashForCausalLM(self.model_cfg)

    def kernel_choice(self):
        from ds_trhash.model import backend

        k = self.train_cfg.kernels
        return backend.resolve(k.policy, self.device, self.model_cfg, require_liger=k.require_liger)


def _adamw(groups, opt_cfg, device: torch.device) -> torch.optim.AdamW:
    kwargs = dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    if device.type == "cuda":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def build_plain(ctx: Ctx, compiled: bool, holder: dict):
    """Cases eager / compile: the model's default backends, weights in the run dtype."""
    from ds_trhash.training.engine import param_groups

    model = ctx.new_model().to(ctx.device, ctx.dtype)
    holder["model"] = model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _adamw(param_groups(model, ctx.train_cfg.optimizer.weight_decay), ctx.train_cfg.optimizer, ctx.device)
    holder["opt"] = opt
    fwd = torch.compile(model) if compiled else model
    holder["fwd"] = fwd
    clip = ctx.train_cfg.optimizer.grad_clip
    ids, labels = ctx.ids, ctx.labels

    def step():
        loss = fwd(ids, labels=labels)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, {"kernel_choice": None}


def build_manual(ctx: Ctx, holder: dict):
    """Case manual: the engine's kernels and numerics (fp32 master weights) without DeepSpeed."""
    from ds_trhash.model import backend
    from ds_trhash.training.engine import param_groups

    model = ctx.new_model()
    choice = ctx.kernel_choice()
    backend.apply(model, choice)
    model = model.to(ctx.device, ctx.dtype)
    holder["model"] = model
    opt_cfg = ctx.train_cfg.optimizer
    groups = param_groups(model, opt_cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    mixed = ctx.dtype != torch.float32
    if mixed:
        masters = {id(p): p.detach().float().clone() for p in params}
        master_groups = [{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups]
        master_list = [masters[id(p)] for p in params]
        for m in master_list:
            m.grad = torch.zeros_like(m)
        master_grads = [m.grad for m in master_list]
        holder["masters"] = master_list
    else:
        master_groups, master_list = groups, params
    opt = _adamw(master_groups, opt_cfg, ctx.device)
    holder["opt"] = opt
    clip = opt_cfg.grad_clip
    ids, labels = ctx.ids, ctx.labels

    def step():
        loss = model(ids, labels=labels)
        loss.backward()
        if mixed:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch._foreach_copy_(master_grads, grads)  # bf16 -> fp32
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(master_list, clip, foreach=True)
        opt.step()
        if mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in params], master_list)  # fp32 -> bf16
        model.zero_grad(set_to_none=True)
        return loss.detach()

    return step, {"kernel_choice": choice.to_dict()}


def build_engine_case(ctx: Ctx, compile_mode: str, holder: dict):
    """Cases engine*: the trainer's build order (resolve, self-check, apply, compile_model,
    build_engine), steps via loop.train_step."""
    from ds_trhash.model import backend, selfcheck
    from ds_trhash.model.compile import compile_model
    from ds_trhash.training import loop
    from ds_trhash.training.engine import build_engine, check_runnable

    cfg = ctx.train_cfg
    check_runnable(cfg, 1)
    model = ctx.new_model()
    choice = selfcheck.verify(ctx.kernel_choice(), cfg.kernels.policy, ctx.device, ctx.model_cfg,
                              dtype=ctx.dtype, require_liger=cfg.kernels.require_liger)
    backend.apply(model, choice)
    compile_model(model, compile_mode)
    model = model.to(ctx.device)
    holder["model"] = model
    total = ctx.args.warmup + ctx.args.steps
    eng = build_engine(model, cfg, ctx.ds_config, total_steps=total)
    holder["engine"] = eng
    batches = [ctx.cpu_batch]
    device = eng.device

    def step():
        return loop.train_step(eng.engine, batches, device, 1)["loss"]

    return step, {"kernel_choice": choice.to_dict(), "compile": compile_mode}


def run_case(name: str, ctx: Ctx, tokens_per_step: int) -> dict:
    args, device = ctx.args, ctx.device
    res: dict = {"case": name, "label": LABELS[name], "status": "ok"}
    if name in COMPILE_CASES and device.type == "cpu" and not args.cpu_compile:
        res.update(status="skipped", reason="torch.compile is not run on CPU unless --cpu-compile")
        return res
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        res["mem_before_gib"] = torch.cuda.memory_allocated(device) / GIB
    holder: dict = {}
    losses = []
    try:
        from torch._dynamo.utils import counters

        counters.clear()  # graph-break counts of this case only
        t0 = time.perf_counter()
        if name in ("eager", "compile"):
            step, info = build_plain(ctx, name == "compile", holder)
        elif name == "manual":
            step, info = build_manual(ctx, holder)
        else:
            step, info = build_engine_case(ctx, ENGINE_CASES[name], holder)
        res.update(info)
        res["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            losses.append(step())
        sync(device)
        res["warmup_s"] = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            sync(device)
            t = time.perf_counter()
            losses.append(step())
            sync(device)
            times.append(time.perf_counter() - t)
        from ds_trhash.model import backend

        res["backends"] = backend.recorded_backends(holder["model"])
        res["step_s"] = times
        res["step_s_median"] = statistics.median(times)
        res["tokens_per_s"] = tokens_per_step / res["step_s_median"]
        res["losses"] = [float(x) for x in losses]
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
            res["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    finally:
        holder.clear()
        step = info = None  # noqa: F841 - drop the closures holding model and optimizer
        free_memory(device)
    return res


# ----------------------------------------------------------------------------- report


def derive(results: dict, peak: dict, nominal: float | None, fpt: float) -> None:
    for r in results.values():
        if r.get("status") != "ok":
            continue
        r["model_tflops"] = r["tokens_per_s"] * fpt / 1e12
        r["mfu_measured"] = r["model_tflops"] / peak["tflops"] if peak.get("tflops") else None
        r["mfu_nominal"] = r["model_tflops"] / nominal if nominal else None


def comparisons(results: dict) -> dict:
    def tps(name):
        r = results.get(name)
        return r["tokens_per_s"] if r and r.get("status") == "ok" else None

    out = {}
    for eng in ENGINE_CASES:
        e = tps(eng)
        if e is None:
            continue
        c = {}
        if tps("manual"):
            c["overhead_vs_manual"] = tps("manual") / e - 1.0  # step-time ratio - 1
        if tps("eager"):
            c["speedup_vs_eager"] = e / tps("eager")
        if tps("compile"):
            c["speedup_vs_compile"] = e / tps("compile")
        c["speedup_vs_anchor_248155"] = e / ANCHOR["compile"]["tokens_per_s"]
        out[eng] = c
    return out


def targets(results: dict, comps: dict, reference_shape: bool) -> list[dict]:
    rows = []
    for eng in ENGINE_CASES:
        r = results.get(eng)
        if not r or r.get("status") != "ok":
            continue
        c = comps.get(eng, {})
        checks = [
            ("tokens/s >= 300,000", r["tokens_per_s"], r["tokens_per_s"] >= TARGETS["tokens_per_s"]),
            ("speed-up vs compile (same run) >= 1.2x", c.get("speedup_vs_compile"),
             None if c.get("speedup_vs_compile") is None else c["speedup_vs_compile"] >= TARGETS["speedup_vs_compile"]),
            ("peak memory <= 20 GiB", r.get("peak_gib"),
             None if r.get("peak_gib") is None else r["peak_gib"] <= TARGETS["peak_gib"]),
            ("engine overhead vs manual <= 5 %", c.get("overhead_vs_manual"),
             None if c.get("overhead_vs_manual") is None else c["overhead_vs_manual"] <= TARGETS["engine_overhead"]),
        ]
        for what, value, ok in checks:
            verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
            if not reference_shape:
                verdict = "n/a (not the 200m/2048/16/bf16 CUDA shape)"
            rows.append({"case": eng, "target": what, "value": value, "verdict": verdict})
    return rows


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def print_report(report: dict) -> None:
    m = report["meta"]
    peak = m["matmul_peak"]
    print(f"\nbench_step: {m['device_name']} | torch {m['versions']['torch']} | deepspeed "
          f"{m['versions']['deepspeed']} | triton {m['versions']['triton']} | liger {m['versions']['liger-kernel']}")
    print(f"shape: preset {m['preset']}, seq {m['seq_len']}, micro batch {m['micro_batch']}, "
          f"{m['precision']}, {m['tokens_per_step']:,} tokens/step, warm-up {m['warmup']}, timed {m['steps']}")
    print(f"FLOPs/token: {m['flops_per_token']:.4g} ({m['flops_source']})")
    print(f"peak: measured {peak['tflops']:.4g} TFLOP/s ({peak['size']}^3 {peak['dtype']} matmul), nominal "
          f"{_fmt(m['nominal_tflops'], '.1f', 'unknown')}{' TFLOP/s' if m['nominal_tflops'] else ''}")
    head = (f"{'case':<22}{'status':<8}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU meas':>9}"
            f"{'MFU nom':>8}{'peak GiB':>9}{'before':>7}  backends")
    print("\n" + head)
    print("-" * len(head))
    for r in report["cases"].values():
        if r["status"] != "ok":
            why = r.get("reason") or r.get("error", "")
            print(f"{r['case']:<22}{r['status']:<8}  {why[:110]}")
            continue
        b = r.get("backends") or {}
        backends = " ".join(f"{k}={v}" for k, v in b.items())
        print(f"{r['case']:<22}{'ok':<8}{r['step_s_median'] * 1e3:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{r['model_tflops']:>9.3g}{_fmt(r['mfu_measured'], '.1%'):>9}{_fmt(r['mfu_nominal'], '.1%'):>8}"
              f"{_fmt(r.get('peak_gib'), '.2f'):>9}{_fmt(r.get('mem_before_gib'), '.2f'):>7}  {backends}")
    for name, c in report["comparisons"].items():
        parts = []
        if "overhead_vs_manual" in c:
            parts.append(f"overhead vs manual {c['overhead_vs_manual']:+.1%}")
        if "speedup_vs_eager" in c:
            parts.append(f"vs eager {c['speedup_vs_eager']:.2f}x")
        if "speedup_vs_compile" in c:
            parts.append(f"vs compile {c['speedup_vs_compile']:.2f}x")
        if report["meta"]["reference_shape"]:
            parts.append(f"vs anchor 248,155 tok/s {c['speedup_vs_anchor_248155']:.2f}x")
        if parts:
            print(f"{name}: " + ", ".join(parts))
    if report["targets"]:
        print("\ntargets")
        for t in report["targets"]:
            v = t["value"]
            shown = "-" if v is None else (f"{v:+.1%}" if "overhead" in t["target"] else f"{v:,.3g}")
            print(f"  {t['case']:<22}{t['target']:<42}{shown:>12}  {t['verdict']}")
    for r in report["cases"].values():
        if r["status"] in ("error", "oom"):
            print(f"\n--- {r['case']} {r['status']}: {r['error']}\n{r.get('traceback', '')}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--preset", choices=("200m", "tiny"), default="200m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per case (3 on CUDA, 1 on CPU)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma separated, from {','.join(CASES)}")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="training config the engine cases use")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2), default=1)
    ap.add_argument("--kernels-policy", choices=("auto", "triton", "pytorch"), default=None,
                    help="override kernels.policy of the config (default: the config's, auto)")
    ap.add_argument("--peak-size", type=int, default=None, help="matmul size for the measured peak "
                    "(8192 on CUDA, 512 on CPU)")
    ap.add_argument("--nominal-tflops", type=float, default=None, help="nominal peak, if the device is not known")
    ap.add_argument("--flops-per-token", type=float, default=None)
    ap.add_argument("--cpu-compile", action="store_true", help="run the compile cases on CPU too")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", default=None, help="write the full report here")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        ap.error(f"--cases: unknown {unknown}; allowed: {','.join(CASES)}")
    args.case_list = cases
    if args.warmup is None:
        args.warmup = 3 if args.device == "cuda" else 1
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_step: --device cuda but no CUDA device here; for the CPU smoke run use "
              "--device cpu --preset tiny --seq-len 64 --micro-batch 2 --steps 2 --precision fp32",
              file=sys.stderr)
        return 2
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
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    # TF32 stays at torch's default (off), as in the trainer: the fp32 GEMMs of the chunked CE
    # backward and of fp32 runs are measured as the project runs them.

    ctx = Ctx(args, device)
    tokens_per_step = args.micro_batch * args.seq_len
    fpt, fpt_source = flops_per_token(args.preset, ctx.model_cfg, args.seq_len, args.flops_per_token)
    peak_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = measure_matmul_peak(device, args.peak_size or (8192 if device.type == "cuda" else 512), peak_dtype)
    nominal = nominal_peak(device, args.nominal_tflops)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_rev": git_rev(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": versions(),
        "preset": args.preset, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "precision": args.precision, "zero": args.zero, "warmup": args.warmup, "steps": args.steps,
        "tokens_per_step": tokens_per_step, "flops_per_token": fpt, "flops_source": fpt_source,
        "matmul_peak": peak, "nominal_tflops": nominal, "config": str(args.config),
        "kernels_policy": ctx.train_cfg.kernels.policy, "cases": args.case_list, "anchor": ANCHOR,
        "targets": TARGETS,
    }
    meta["reference_shape"] = (device.type == "cuda" and args.preset == "200m" and args.seq_len == 2048
                               and args.micro_batch == 16 and args.precision == "bf16")
    results = {}

    def build_report() -> dict:
        derive(results, peak, nominal, fpt)
        comps = comparisons(results)
        return {"meta": meta, "cases": results, "comparisons": comps,
                "targets": targets(results, comps, meta["reference_shape"])}

    def write_json(report: dict) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2, default=str))

    for name in args.case_list:
        print(f"[bench_step] {name}: {LABELS[name]} ...", flush=True)
        results[name] = run_case(name, ctx, tokens_per_step)
        r = results[name]
        if r["status"] == "ok":
            print(f"[bench_step] {name}: {r['step_s_median'] * 1e3:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s",
                  flush=True)
        else:
            print(f"[bench_step] {name}: {r['status']} {r.get('reason') or r.get('error', '')[:200]}", flush=True)
        write_json(build_report())  # partial results survive a run cut short
    report = build_report()
    print_report(report)
    write_json(report)
    if args.json:
        print(f"\nwrote {args.json}")
    failed = [n for n, r in results.items() if r["status"] in ("error", "oom")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
