"""Kernel policy: which implementation runs the routed experts, the loss and the norms (docs/contracts.md §7).

``resolve(policy, device, config, require_liger=False) -> KernelChoice`` decides;
``apply(model, choice)`` installs the choice on a model; ``recorded_backends(model)`` reads what
actually executed in the last forward (the run record uses that, never the flag).

Policy table (docs/kernels.md has the long form):

=========  ===========================  ================================================
policy     CUDA                         CPU
=========  ===========================  ================================================
auto       Triton experts if the kernel PyTorch experts, chunked loss, PyTorch norm
           imports and the shape/dtype  (logged)
           is supported, else PyTorch;
           Liger loss+norm(+RoPE) if
           Liger imports, else chunked
           loss / PyTorch norm (logged)
triton     Triton experts or            Triton experts under TRITON_INTERPRET=1, chunked
           BackendError; Liger as auto  loss, PyTorch norm; else BackendError
pytorch    PyTorch experts, chunked     PyTorch experts, chunked loss, PyTorch norm
           loss, PyTorch norm
=========  ===========================  ================================================

``require_liger=True`` (production SFT profile): on CUDA, Liger missing -> BackendError, and
policy "pytorch" contradicts it -> BackendError. Off CUDA Liger cannot run at all, so the
requirement is logged and the chunked loss is used.

The availability probes (`_cuda_usable`, `_interpreter_enabled`, `_triton_kernels_available`,
`_liger_available`) are module-level functions so tests can monkeypatch them.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol, cast

import torch

from ds_trhash.config_fields import positive, setting
from ds_trhash.errors import UserError

from .config import TRHashConfig

from .attention import ROPE_BACKENDS
from .experts import EXPERT_BACKENDS
from .loss import LOSS_BACKENDS
from .norms import NORM_BACKENDS


logger = logging.getLogger(__name__)

POLICIES = ("auto", "triton", "pytorch")


@dataclass(frozen=True)
class KernelsSection:
    """The config's ``kernels:`` section (the YAML keys are these field names); ``policy`` is one
    of ``POLICIES``."""

    policy: Literal["auto", "triton", "pytorch"] = "auto"
    require_liger: bool = False
    loss_chunk_tokens: int = setting(1024, check=positive)
    # inductor on the engine path: none, each decoder layer, or the whole model (model/compile.py)
    compile: Literal["none", "layers", "model"] = "none"
    # routed experts: auto (the policy's choice; on CUDA the Triton kernel and the dense masked path
    # timed at the launch's shape, the faster runs: model/expert_probe.py) or one of them fixed
    experts: Literal["auto", "triton", "masked", "pytorch"] = "auto"


#: Widest routed expert the Triton kernel is selected for (a block holds the full width).
MAX_TRITON_EXPERT_WIDTH = 256
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class BackendError(UserError, RuntimeError):
    """A requested kernel backend cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class KernelChoice:
    experts: str  # "triton" | "pytorch"
    loss: str  # "liger" | "chunked" | "plain"
    norm: str  # "liger" | "pytorch"
    reason: str
    rope: str = "pytorch"  # "liger" | "pytorch"; passed on only if the model accepts it
    # component -> "passed" | "failed, using <fallback>: <why>" (ds_trhash.model.selfcheck)
    self_check: dict[str, str] = field(default_factory=dict, compare=False)
    # the per-shape measurement that picked the experts backend (ds_trhash.model.expert_probe)
    experts_probe: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for field, allowed in (("experts", EXPERT_BACKENDS), ("loss", LOSS_BACKENDS),
                               ("norm", NORM_BACKENDS), ("rope", ROPE_BACKENDS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"KernelChoice.{field}={value!r}; allowed: {list(allowed)}")

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ availability probes


def _cuda_usable(device: torch.device) -> bool:
    """True when `device` is a CUDA device that this process can actually use."""
    return device.type == "cuda" and torch.cuda.is_available()


def _interpreter_enabled() -> bool:
    """The Triton CPU interpreter is on (must have been set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _import_error(module: str) -> Optional[str]:
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a triton/driver error raised at import time
        return f"{type(exc).__name__}: {exc}"
    return None


def _triton_kernels_available() -> Optional[str]:
    """None when the routed-experts kernel imports, else the reason it does not."""
    return _import_error("ds_trhash.kernels.routed_experts")


def _liger_available() -> Optional[str]:
    """None when Liger's fused linear CE, RMSNorm and RoPE functions import, else the reason."""
    module = "liger_kernel.transformers.functional"  # what ds_trhash.model.loss/norms call
    err = _import_error(module)
    if err is not None:
        return f"{module}: {err}"
    mod = importlib.import_module(module)
    for name in ("liger_fused_linear_cross_entropy", "liger_rms_norm", "liger_rope"):
        if not hasattr(mod, name):
            return f"{module} has no {name}"
    return None


# ------------------------------------------------------------------ shape support


def _expert_shape_problem(config: TRHashConfig | None, dtype: Optional[torch.dtype]) -> Optional[str]:
    """None when the Triton experts kernel supports this model shape and dtype."""
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"dtype {dtype} is not supported by the Triton experts (supported: {TRITON_DTYPES})"
    if config is None:
        return None
    width = getattr(config, "expert_width", None)
    top_k = getattr(config, "top_k", 2)
    if width is not None and width > MAX_TRITON_EXPERT_WIDTH:
        return (f"expert_width {width} > {MAX_TRITON_EXPERT_WIDTH}, the widest the Triton "
                f"experts kernel is selected for")
    if top_k != 2:
        return f"top_k {top_k} != 2 (the kernel reduces exactly two routes per token)"
    return None


# ------------------------------------------------------------------ policy


def _fused_backends(policy: str, on_cuda: bool, require_liger: bool, notes: list[str]) -> tuple[str, str, str]:
    """(loss, norm, rope): Liger on CUDA when importable, else PyTorch (``notes`` says why)."""
    liger_err = _liger_available() if on_cuda else "not on a usable CUDA device"
    if policy == "pytorch":
        if require_liger and on_cuda:
            raise BackendError(
                "kernel policy 'pytorch' contradicts require_liger: Liger is required by this "
                "profile; use kernels.policy auto or triton")
        notes.append("policy pytorch: PyTorch experts, chunked loss, PyTorch norm")
        return "chunked", "pytorch", "pytorch"
    if liger_err is None:
        notes.append("Liger fused linear CE + RMSNorm + RoPE")
        return "liger", "liger", "liger"
    if require_liger and on_cuda:
        raise BackendError(
            f"Liger could not be imported ({liger_err}); Liger is required by this profile; "
            "install liger-kernel (pip install liger-kernel) or use a profile without "
            "kernels.require_liger")
    msg = f"Liger unavailable ({liger_err}): chunked loss and PyTorch norm"
    if require_liger:
        msg += " (require_liger applies on CUDA only)"
    notes.append(msg)
    log = logger.warning if on_cuda else logger.info
    log("kernel fallback: %s", msg)
    return "chunked", "pytorch", "pytorch"


def _triton_experts_problem(policy: str, device: torch.device, on_cuda: bool, config: TRHashConfig | None,
                            dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why the Triton routed experts cannot run here, or None when they can."""
    runnable = on_cuda or (device.type == "cpu" and _interpreter_enabled())
    if policy == "auto" and not on_cuda:
        return f"device {device} is not a usable CUDA device"
    if not runnable:
        return (f"device {device} cannot run Triton: no usable CUDA device and "
                "TRITON_INTERPRET=1 is not set (the CPU interpreter must be enabled "
                "before triton is imported)")
    import_err = _triton_kernels_available()
    if import_err is not None:
        return f"the Triton experts kernel does not import ({import_err})"
    problem = _expert_shape_problem(config, dtype)
    if problem is None and not on_cuda and dtype == torch.bfloat16:
        problem = "the Triton CPU interpreter computes bf16 wrongly (use fp32 or fp16 on CPU)"
    return problem


def _experts_backend(policy: str, device: torch.device, on_cuda: bool, config: TRHashConfig | None,
                     dtype: Optional[torch.dtype], notes: list[str]) -> str:
    if policy == "pytorch":
        return "pytorch"
    problem = _triton_experts_problem(policy, device, on_cuda, config, dtype)
    if problem is None:
        notes.append("Triton routed experts" + ("" if on_cuda else " (CPU interpreter)"))
        return "triton"
    if policy == "triton":
        raise BackendError(f"kernel policy 'triton' cannot run: {problem}; use policy auto or pytorch")
    msg = f"PyTorch routed experts: {problem}"
    notes.append(msg)
    (logger.warning if on_cuda else logger.info)("kernel fallback: %s", msg)
    return "pytorch"


def resolve(policy: str, device: torch.device | str, config: TRHashConfig | None = None, require_liger: bool = False,
            dtype: Optional[torch.dtype] = None) -> KernelChoice:
    """Pick the implementations for `device`/`config` under `policy` ("auto"|"triton"|"pytorch").

    `dtype` (optional) is the training compute dtype; unsupported dtypes make auto fall back
    and "triton" raise. Every fallback is logged; impossible requests raise BackendError.
    """
    if policy not in POLICIES:
        raise BackendError(f"unknown kernel policy {policy!r}; allowed: {list(POLICIES)}")
    device = torch.device(device)
    on_cuda = _cuda_usable(device)
    notes: list[str] = []
    loss, norm, rope = _fused_backends(policy, on_cuda, require_liger, notes)
    experts = _experts_backend(policy, device, on_cuda, config, dtype, notes)
    choice = KernelChoice(experts=experts, loss=loss, norm=norm, rope=rope,
                          reason=f"policy {policy} on {device}: " + "; ".join(notes))
    # debug: a launch states its kernels once, in the start-up summary (training/summary.py)
    logger.debug("kernel choice: experts=%s loss=%s norm=%s rope=%s (%s)",
                 choice.experts, choice.loss, choice.norm, choice.rope, choice.reason)
    return choice


class BackendModel(Protocol):
    """What a model offers for its kernels to be chosen and reported (TRHashForCausalLM does)."""

    kernel_self_check: dict[str, str]

    def set_backends(self, experts: str | None = None, loss: str | None = None,
                     norm: str | None = None, rope: str | None = None) -> None: ...

    def backends_used(self) -> dict[str, object]: ...


def _unwrap(model: torch.nn.Module) -> BackendModel:
    """The module under a DeepSpeed engine / DDP wrapper (they expose it as `.module`)."""
    while not hasattr(model, "set_backends") and hasattr(model, "module"):
        model = cast(torch.nn.Module, model.module)
    return cast(BackendModel, model)


def apply(model: torch.nn.Module, choice: KernelChoice) -> None:
    """Install `choice` on the model via model.set_backends(experts=, loss=, norm=[, rope=])."""
    target = _unwrap(model)
    kwargs = {"experts": choice.experts, "loss": choice.loss, "norm": choice.norm}
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(target.set_backends).parameters
    except (TypeError, ValueError):
        params = {}
    if "rope" in params:
        kwargs["rope"] = choice.rope
    target.set_backends(**kwargs)
    if choice.self_check:
        target.kernel_self_check = dict(choice.self_check)  # reported with the backends that ran
    if choice.experts_probe and hasattr(target, "experts_probe"):
        target.experts_probe = dict(choice.experts_probe)


def recorded_backends(model: torch.nn.Module) -> dict[str, object]:
    """What actually executed in the last forward (model.backends_used()), for metrics/records."""
    return dict(_unwrap(model).backends_used())
