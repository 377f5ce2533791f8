"""Which routed-experts implementation is faster at this launch's shape, measured on its GPU.

The Triton kernel runs each expert only on its tokens but is bound by launches at small expert
widths; the dense masked path (``experts.routed_experts_masked``: every expert on every token,
weighted by the route mask) does twice the FLOPs in a few large GEMMs. Which wins depends on
the shape (tokens per forward, hidden size, expert width and count, dtype), so under
``kernels.experts: auto`` a launch whose policy chose the Triton kernel on CUDA times both,
forward and backward, on random inputs of its own shape (a few repetitions after a warm-up,
CUDA events), agrees the timings over the ranks (summed, so every rank picks the same) and runs
the faster. The result is cached per shape in the process and recorded in ``KernelChoice``
(``experts_probe``: the shape, each candidate's milliseconds and the pick), so the start-up
summary's kernels line and the run record say what was measured. ``kernels.experts`` set to
``triton``, ``masked`` or ``pytorch`` skips the measurement. Off CUDA nothing is measured (the
interpreter's timings mean nothing).

Timing is injectable (``timer``), so the decision is tested on the CPU; the measurement itself
runs on the device.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ds_trhash.ranks import is_multi_rank

from .backend import BackendError, KernelChoice
from .experts import routed_experts

CANDIDATES = ("triton", "masked")
OVERRIDES = ("auto", "triton", "masked", "pytorch")
#: the Triton kernel (the policy's choice) is kept unless the other is this much faster
MARGIN = 0.05

Timer = Callable[[str, "Shape"], float]


@dataclasses.dataclass(frozen=True)
class Shape:
    tokens: int  # rows of one forward: micro batch x sequence length
    hidden: int
    width: int
    experts: int
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        return (f"{self.tokens} tokens, hidden {self.hidden}, {self.experts} experts of width {self.width}, "
                f"{str(self.dtype).removeprefix('torch.')}")


_CACHE: dict[Shape, dict[str, Any]] = {}


def decide(ms: Mapping[str, float], prefer: str = "triton", margin: float = MARGIN) -> str:
    """The fastest candidate; ``prefer`` unless another is faster by more than ``margin``."""
    best = min(ms, key=ms.__getitem__)
    return prefer if prefer in ms and ms[best] >= ms[prefer] * (1 - margin) else best


def time_backend(backend: str, shape: Shape, repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of forward + backward of ``backend`` at ``shape`` (CUDA events). The
    inputs come from a private generator: the global RNG streams (and so resume) are untouched."""
    gen = torch.Generator(device=shape.device).manual_seed(0)
    n, h, w, e = shape.tokens, shape.hidden, shape.width, shape.experts

    def rand(*size: int) -> torch.Tensor:
        return (0.1 * torch.randn(*size, generator=gen, device=shape.device)).to(shape.dtype)

    x, gate, up, down = (t.requires_grad_() for t in (rand(n, h), rand(e, h, w), rand(e, h, w), rand(e, w, h)))
    first = torch.randint(0, e, (n,), generator=gen, device=shape.device)
    routes = torch.stack([first, (first + torch.randint(1, max(e, 2), (n,), generator=gen,
                                                         device=shape.device)) % e], dim=1)
    dy = rand(n, h)
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = routed_experts(x, routes, gate, up, down, (0.5, 0.5), backend=backend)
        torch.autograd.grad(y, (x, gate, up, down), dy)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _summed_over_ranks(ms: dict[str, float], device: torch.device) -> dict[str, float]:
    if not is_multi_rank():
        return ms
    on = device if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor([ms[c] for c in CANDIDATES], dtype=torch.float64, device=on)
    torch.distributed.all_reduce(t)
    return dict(zip(CANDIDATES, (float(v) for v in t.tolist())))


def measure(shape: Shape, timer: Timer = time_backend,
            agree: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, Any]:
    """{"shape", "ms": {candidate: ms}, "chosen"} at ``shape``, measured once per process."""
    if shape not in _CACHE:
        ms = {c: float(timer(c, shape)) for c in CANDIDATES}
        ms = agree(ms) if agree is not None else _summed_over_ranks(ms, shape.device)
        _CACHE[shape] = {"shape": shape.describe(), "ms": {c: round(v, 4) for c, v in ms.items()},
                         "chosen": decide(ms)}
    return _CACHE[shape]


def choose_experts(choice: KernelChoice, override: str, shape: Shape, *, timer: Timer = time_backend,
                   agree: Callable[[dict[str, float]], dict[str, float]] | None = None) -> KernelChoice:
    """``choice`` with its experts backend settled for ``shape`` (see the module docstring).
    Under torch.distributed every rank must call it (the timings are agreed)."""
    if override not in OVERRIDES:
        raise BackendError(f"kernels.experts {override!r}; allowed: {list(OVERRIDES)}")
    if override != "auto":
        if override == "triton" and choice.experts != "triton":
            raise BackendError(f"kernels.experts triton, but the kernel policy could not select the Triton "
                               f"experts ({choice.reason}); use kernels.experts auto, masked or pytorch")
        return dataclasses.replace(choice, experts=override,
                                   reason=f"{choice.reason}; experts {override} (kernels.experts)")
    if choice.experts != "triton" or shape.device.type != "cuda":
        return choice
    probe = measure(shape, timer, agree)
    timings = ", ".join(f"{c} {v:.3f} ms" for c, v in probe["ms"].items())
    return dataclasses.replace(choice, experts=probe["chosen"], experts_probe=dict(probe),
                               reason=f"{choice.reason}; experts measured at {probe['shape']}: {timings} "
                                      f"-> {probe['chosen']}")
