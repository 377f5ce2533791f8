"""Kernel self-check: every selected fused kernel is run once against its PyTorch reference.

``verify(choice, policy, device, config, dtype) -> KernelChoice`` runs, on the training device
and in the training dtype, each kernel that ``backend.resolve`` selected (Triton routed experts,
Liger loss, Liger RMSNorm, Liger RoPE) on a small random batch, forward and backward, and compares
output and input gradients with the PyTorch path. A kernel that raises or disagrees beyond the
tolerance is replaced by its PyTorch path under policy ``auto`` (the reason is logged as a
warning and kept in ``KernelChoice.reason`` and ``KernelChoice.self_check``); under an explicit policy
``triton``, or a Liger kernel under ``require_liger``, it raises BackendError instead (the
launcher turns that into exit 2). With several ranks the failures are agreed over them first, so
every rank runs the same kernels and a refusal stops every rank.

The random batch comes from a private generator: the global RNG streams (and so resume) are
untouched. Triton autotuning results from the small batch are dropped afterwards so the real
batch tunes for its own size.

Test hook: ``DS_TRHASH_FAULTY_KERNEL=experts,loss,norm,rope`` (any subset) makes the named
kernels compute a wrong result (output scaled by 1.1) during the self-check only, as a kernel
that is broken on this device would; docs/kernels.md documents it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Optional

import torch

from ds_trhash.ranks import is_multi_rank

from .attention import apply_rope, rope_cos_sin
from .backend import BackendError, KernelChoice
from .config import TRHashConfig
from .experts import routed_experts
from .loss import tied_ce
from .norms import rms_norm

logger = logging.getLogger(__name__)

FAULT_ENV = "DS_TRHASH_FAULTY_KERNEL"
#: The PyTorch path each fused kernel falls back to.
FALLBACK = {"experts": "pytorch", "loss": "chunked", "norm": "pytorch", "rope": "pytorch"}
#: Relative error (output and every input gradient, by norm) allowed per compute dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 3e-2}
_TOKENS = 96  # rows of the random batch: several tiles per expert, still tiny


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def _compare(candidate: Callable, reference: Callable, inputs: list[torch.Tensor], tol: float,
             faulty: bool) -> Optional[str]:
    """None when candidate(*inputs) matches reference(*inputs) in value and input gradients."""
    def run(fn: Callable[..., torch.Tensor], scale: float = 1.0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = fn(*leaves) * scale
        probe = torch.ones_like(out) if out.dim() == 0 else torch.linspace(-1, 1, out.numel(),
                                                                          device=out.device).view_as(out)
        diff = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad((out.float() * probe.float()).sum(), diff, allow_unused=True)
        return out.detach(), grads

    try:
        got, got_grads = run(candidate, 1.1 if faulty else 1.0)
    except Exception as exc:  # any failure of the kernel on this device means: do not use it
        return f"raised {type(exc).__name__}: {exc}"
    want, want_grads = run(reference)
    errors = [("output", _rel_err(got, want))]
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        if (g is None) != (w is None):
            return f"gradient of input {i} is {'missing' if g is None else 'unexpected'}"
        if g is not None:
            errors.append((f"gradient of input {i}", _rel_err(g, w)))
    worst = max(errors, key=lambda e: e[1])
    if not worst[1] <= tol:  # also catches NaN
        return f"{worst[0]} differs from the PyTorch reference by {worst[1]:.3g} (tolerance {tol:g})"
    return None


def _randn(gen: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _check_experts(config: TRHashConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator, tol: float,
                   faulty: bool) -> Optional[str]:
    h, w, e = config.hidden_size, config.expert_width, config.num_experts
    routes = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(_TOKENS)]).to(device)
    inputs = [_randn(gen, (_TOKENS, h), device, dtype), _randn(gen, (e, h, w), device, dtype, h ** -0.5),
              _randn(gen, (e, h, w), device, dtype, h ** -0.5), _randn(gen, (e, w, h), device, dtype, w ** -0.5)]

    def call(backend: str) -> Callable[..., torch.Tensor]:
        return lambda x, g, u, d: routed_experts(x, routes, g, u, d, config.route_weights, backend=backend)

    problem = _compare(call("triton"), call("pytorch"), inputs, tol, faulty)
    _reset_triton_autotuning()
    return problem


def _reset_triton_autotuning() -> None:
    """Forget configs tuned on the self-check's batch (the autotune keys omit the row count)."""
    try:
        # lazy: only reached after the Triton experts ran, so triton is importable and loaded
        from ds_trhash.kernels.routed_experts import reset_autotuning
    except ImportError:
        return
    reset_autotuning()


def _check_loss(config: TRHashConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator, tol: float,
                faulty: bool) -> Optional[str]:
    vocab = min(config.vocab_size, 2048)
    labels = torch.randint(0, vocab, (_TOKENS,), generator=gen)
    labels[::7] = -100  # ignored positions take part too
    labels = labels.to(device)
    inputs = [_randn(gen, (_TOKENS, config.hidden_size), device, dtype),
              _randn(gen, (vocab, config.hidden_size), device, dtype, 0.02)]

    def call(backend: str) -> Callable[..., torch.Tensor]:
        return lambda hidden, weight: tied_ce(hidden, weight, labels, backend, reduction="sum")

    return _compare(call("liger"), call("chunked"), inputs, tol, faulty)


def _check_norm(config: TRHashConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator, tol: float,
                faulty: bool) -> Optional[str]:
    # lazy: Liger (and triton under it) is optional and only checked when the policy chose it
    from liger_kernel.transformers.functional import liger_rms_norm

    eps = config.norm_eps
    inputs = [_randn(gen, (_TOKENS, config.hidden_size), device, dtype),
              (1 + _randn(gen, (config.hidden_size,), device, torch.float32, 0.1)).to(dtype)]
    return _compare(lambda x, w: liger_rms_norm(x, w, eps, in_place=False),
                    lambda x, w: rms_norm(x, w, eps), inputs, tol, faulty)


def _check_rope(config: TRHashConfig, device: torch.device, dtype: torch.dtype, gen: torch.Generator, tol: float,
                faulty: bool) -> Optional[str]:
    # lazy: as in _check_norm
    from liger_kernel.transformers.functional import liger_rope

    t, d = 32, config.head_dim
    cos, sin = rope_cos_sin(torch.arange(t, device=device)[None], d, config.rope_theta)
    inputs = [_randn(gen, (1, config.num_heads, t, d), device, dtype),
              _randn(gen, (1, config.num_kv_heads, t, d), device, dtype)]

    def liger(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, k = liger_rope(q, k, cos, sin)
        return torch.cat((q.flatten(), k.flatten()))

    def reference(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.cat((apply_rope(q, cos, sin).flatten(), apply_rope(k, cos, sin).flatten()))

    return _compare(liger, reference, inputs, tol, faulty)


#: component -> (the fused name that is checked, its check)
CHECKS = {"experts": ("triton", _check_experts), "loss": ("liger", _check_loss),
          "norm": ("liger", _check_norm), "rope": ("liger", _check_rope)}


def faulty_kernels() -> set[str]:
    """Components named by the test hook DS_TRHASH_FAULTY_KERNEL (unknown names refused)."""
    raw = os.environ.get(FAULT_ENV, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = sorted(names - set(CHECKS))
    if unknown:
        raise BackendError(f"{FAULT_ENV}={raw!r} names unknown kernels {unknown}; allowed: {sorted(CHECKS)}")
    return names


def _failed_anywhere(failed: list[bool], device: torch.device) -> list[bool]:
    """Each component's failure flag OR-ed over the ranks, so that every rank runs the same
    kernels (and every rank raises, rather than one rank leaving the others in a collective)."""
    if not is_multi_rank():
        return failed
    flags = torch.tensor([int(f) for f in failed], dtype=torch.int32,
                         device=device if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def verify(choice: KernelChoice, policy: str, device: torch.device | str, config: TRHashConfig,
           dtype: torch.dtype = torch.float32, require_liger: bool = False) -> KernelChoice:
    """Self-check every fused kernel in `choice`; return the choice that may run (see module doc).

    Under torch.distributed every rank must call it (the failures are agreed over the ranks)."""
    device = torch.device(device)
    faulty = faulty_kernels()
    tol = TOLERANCE.get(dtype, 3e-2)
    gen = torch.Generator().manual_seed(0x5E1F)
    problems: dict[str, str | None] = {}
    for component, (fused, check) in CHECKS.items():
        if getattr(choice, component) == fused:
            problems[component] = check(config, device, dtype, gen, tol, component in faulty)
    # one flag per known component, whatever this rank selected: every rank reduces the same shape
    agreed = dict(zip(CHECKS, _failed_anywhere([problems.get(c) is not None for c in CHECKS], device)))
    results: dict[str, str] = {}
    changes: dict[str, str] = {}
    notes: list[str] = []
    for component, problem in problems.items():
        fused = CHECKS[component][0]
        if not agreed[component]:
            results[component] = "passed"
            continue
        problem = problem or "failed on another rank"
        message = f"self-check of the {fused} {component} kernel on {device} ({dtype}) failed: {problem}"
        if policy == "triton" and component == "experts":
            raise BackendError(f"{message}; kernel policy 'triton' requires it (use policy auto to fall "
                               "back to PyTorch, or pytorch)")
        if require_liger and fused == "liger" and device.type == "cuda":
            raise BackendError(f"{message}; Liger is required by this profile (kernels.require_liger)")
        results[component] = f"failed, using {FALLBACK[component]}: {problem}"
        changes[component] = FALLBACK[component]
        notes.append(f"{message}; falling back to {FALLBACK[component]}")
        logger.warning("kernel fallback: %s", notes[-1])
    if not results:
        return choice
    reason = choice.reason + "".join(f"; {n}" for n in notes)
    return dataclasses.replace(choice, reason=reason, self_check=results,
                               experts=changes.get("experts", choice.experts), loss=changes.get("loss", choice.loss),
                               norm=changes.get("norm", choice.norm), rope=changes.get("rope", choice.rope))
