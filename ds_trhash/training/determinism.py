"""Deterministic GPU kernels, so that a resumed run repeats the uninterrupted one bit for bit.

Exact resume needs every step to compute the same bits twice. On CPU every kernel the trainer
runs already does. On a GPU our Triton experts sum in a fixed order and Liger's kernels (fused
linear CE, RMSNorm, RoPE) reduce without atomics, but two others do not by default:
FlashAttention's backward (SDPA) accumulates dQ with atomic adds, and cuBLAS may pick
split-reduction kernels whose order depends on its workspace. ``training.deterministic: true``
(the default) turns on PyTorch's deterministic algorithms (the flash backward then runs its
deterministic variant) and fixes cuBLAS's workspace (``CUBLAS_WORKSPACE_CONFIG``, read when
cuBLAS starts, so this runs before the first matmul on the device: before the kernel self-check).
``warn_only``: an op without a deterministic CUDA implementation warns instead of stopping the run
(the expert-load counts use an integer scatter-add, exact in any order). The start-up summary says
which mode ran (``describe``).
"""
from __future__ import annotations

import os

import torch

__all__ = ["CUBLAS_WORKSPACE", "use_deterministic_kernels", "describe"]

#: cuBLAS's documented setting for reproducible results (one 4 MiB workspace per stream, 8 slots).
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_kernels(enabled: bool, on_cuda: bool | None = None) -> None:
    """Apply ``training.deterministic`` to this process; a no-op off CUDA (nothing to change)."""
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    if not (enabled and on_cuda):
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)


def describe(enabled: bool, device_type: str) -> str:
    """The start-up summary's line: what this launch does to make its steps repeatable."""
    if device_type != "cuda":
        return "on CPU: every kernel already sums in a fixed order (nothing to set)"
    if not enabled:
        return ("off (training.deterministic false): FlashAttention's backward and cuBLAS may sum in a "
                "varying order, so a resumed run can differ from the uninterrupted one in the last bits")
    return (f"on: torch.use_deterministic_algorithms (FlashAttention's deterministic backward), "
            f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}")
