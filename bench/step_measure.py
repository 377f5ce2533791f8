"""Measuring helpers of bench_step.py: FLOPs per token, device syncs and cleanup, the measured
matmul peak, versions, and one step under torch.profiler."""
from __future__ import annotations

import gc
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from ds_trhash.model.flops import nominal_bf16_tflops, train_flops_per_token

REPO = Path(__file__).resolve().parents[1]
#: Training FLOPs per token of the 200m preset at sequence 2,048 (the speed issue's constant).
FLOPS_PER_TOKEN_200M_2048 = 1.35e9


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


def profile_step(step, args, device: torch.device, name: str) -> dict:
    """One more step under torch.profiler: the ops that took the most self time (host, and device
    on CUDA), how many ops ran, and with --profile-dir the Chrome trace of the step."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, device_key), reverse=True)[:args.profile]
    out = {"sorted_by": device_key, "ops": int(sum(e.count for e in events)),
           "top": [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                    "cpu_total_ms": e.cpu_time_total / 1e3,
                    "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in top]}
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        out["trace"] = str(Path(args.profile_dir) / f"{name}.pt.trace.json")
        prof.export_chrome_trace(out["trace"])
    return out
