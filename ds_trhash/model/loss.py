"""Tied-head cross entropy: plain, chunked (docs/contracts.md §7) and Liger's fused kernel.

All three share one contract: labels are already aligned with the hidden rows (no shift
here), -100 is ignored, "mean" divides the summed loss by the number of valid labels and a
batch without any valid label gives loss 0 with zero gradients rather than NaN.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# The label of a position that is not trained on (prompt tokens, separators, padding): the one
# definition every producer of labels (data) and every counter of them (training, eval) imports.
IGNORE_INDEX = -100
LOSS_BACKENDS = ("plain", "chunked", "liger")
REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown loss reduction {reduction!r}; allowed: {list(REDUCTIONS)}")


def _divisor(labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """fp32 scalar on labels' device: kept a tensor so the loss never waits on the host."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=labels.device)
    return (labels != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)


def plain_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
    """hidden [N, H], weight [V, H], labels [N]; materialises the full [N, V] logits."""
    _check_reduction(reduction)
    logits = (hidden @ weight.t()).float()
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / _divisor(labels, reduction)


class _ChunkedCE(torch.autograd.Function):
    """Scores chunk by chunk and recomputes each chunk's logits in backward.

    Only hidden, weight, labels and one fp32 log-sum-exp per token are saved, so the largest
    live activation is a single [chunk, V] block in forward and in backward.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # Any: autograd ctx
                chunk_tokens: int, divisor: torch.Tensor) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            logits = (hidden[start:stop] @ weight.t()).float()  # [c, V]
            lab = labels[start:stop]
            valid = lab != IGNORE_INDEX
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, lab.clamp(min=0)[:, None]).squeeze(1)
            total += ((chunk_lse - target) * valid).sum()
            lse[start:stop] = chunk_lse
        ctx.save_for_backward(hidden, weight, labels, lse, divisor)
        ctx.chunk_tokens = chunk_tokens
        return total / divisor

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # Any: autograd ctx
        hidden, weight, labels, lse, divisor = ctx.saved_tensors
        scale = grad_out.float() / divisor
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # fp32 accumulator across chunks; skipped when the head is frozen (LoRA).
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            h = hidden[start:stop]
            lab = labels[start:stop]
            valid = lab != IGNORE_INDEX
            # d loss / d logits = softmax - onehot, reusing the logits buffer in place.
            grad_logits = (h @ weight.t()).float().sub_(lse[start:stop, None]).exp_()
            # minus one at each valid target (ignored rows are zeroed below): no data-dependent shape
            grad_logits.scatter_add_(1, lab.clamp(min=0)[:, None], -valid.to(torch.float32)[:, None])
            grad_logits.mul_((valid.to(torch.float32) * scale)[:, None])
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), h.float())
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None


def chunked_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               chunk_tokens: int = 1024, reduction: str = "mean") -> torch.Tensor:
    """Same value and gradients as plain_ce with memory bounded by chunk_tokens · V."""
    _check_reduction(reduction)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    divisor = _divisor(labels, reduction)
    return _ChunkedCE.apply(hidden, weight, labels, chunk_tokens, divisor)


# Never traced by dynamo: Liger's function reads the valid-label count with ``.item()`` (a graph
# break inside its autograd Function, after which dynamo resumes tracing in the middle of it) and
# writes its gradients into slices of preallocated buffers from Triton kernels. Traced under
# ``kernels.compile: model`` that gave non-finite gradients on a GPU (Liger-Kernel PR #1338: a
# wrong loss under torch.compile when labels hold ignore_index). Under compilation ``tied_ce``
# calls it through ``torch.compiler.disable``, so a compiled model breaks its graph once, here,
# and the fused loss runs as in eager mode (docs/kernels.md). The disabled wrapper is made at the
# first compilation (``keep_liger_outside_graph``), not at import: making it imports dynamo
# (about 1.2 s), which no eager process (a data command, an uncompiled launch) needs.
def liger_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
    """Liger's fused linear cross entropy, brought to the shared contract (0 valid -> 0)."""
    _check_reduction(reduction)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    total = liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX,
                                             reduction="sum")
    return total.float() / _divisor(labels, reduction)


def tied_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, backend: str,
            reduction: str = "mean", chunk_tokens: int = 1024) -> torch.Tensor:
    """Dispatch by backend name, so the model holds a string rather than a function."""
    if backend == "plain":
        return plain_ce(hidden, weight, labels, reduction)
    if backend == "chunked":
        return chunked_ce(hidden, weight, labels, chunk_tokens, reduction)
    if backend == "liger":
        if torch.compiler.is_compiling():
            return keep_liger_outside_graph()(hidden, weight, labels, reduction)
        return liger_ce(hidden, weight, labels, reduction)
    raise ValueError(f"unknown loss backend {backend!r}; allowed: {list(LOSS_BACKENDS)}")


_liger_outside_graph: Callable[..., torch.Tensor] | None = None


def keep_liger_outside_graph() -> Callable[..., torch.Tensor]:
    """``liger_ce`` behind ``torch.compiler.disable``, made once. ``compile_model`` calls it
    before it compiles, so dynamo meets a ready wrapper rather than its making."""
    global _liger_outside_graph
    if _liger_outside_graph is None:
        _liger_outside_graph = torch.compiler.disable(liger_ce)
    return _liger_outside_graph
