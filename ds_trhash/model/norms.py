"""RMSNorm with a switchable implementation (PyTorch reference or Liger's fused kernel)."""
from __future__ import annotations

import torch
from torch import nn

NORM_BACKENDS = ("pytorch", "liger")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm: statistics in fp32 so bf16 activations do not lose the scale.

    The normalised value is cast back before the weight multiply (the "llama" casting mode),
    matching what Liger's kernel computes, so switching backends does not shift numerics.
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    """Holds the scale; records which implementation ran so run records can be truthful."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = "pytorch"
        self.last_backend: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "liger":
            from liger_kernel.transformers.functional import liger_rms_norm

            shape = x.shape
            # Liger works on a contiguous 2-D view; in_place=False keeps autograd of x intact.
            out = liger_rms_norm(x.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps,
                                 in_place=False).view(shape)
        elif self.backend == "pytorch":
            out = rms_norm(x, self.weight, self.eps)
        else:
            raise ValueError(f"unknown norm backend {self.backend!r}; allowed: {list(NORM_BACKENDS)}")
        self.last_backend = self.backend
        return out

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)
