"""Triton kernels for TR-HASH, installed as ``ds_trhash.kernels``.

Importing this package does not import triton; the kernel modules are loaded on first use, so
callers (and tests) can set ``TRITON_INTERPRET`` before triton is imported.
"""
from __future__ import annotations

import importlib

__all__ = ["routed_experts_triton"]


def __getattr__(name):
    if name == "routed_experts_triton":
        return importlib.import_module(".routed_experts", __name__).routed_experts_triton
    if name == "routed_experts":
        return importlib.import_module(".routed_experts", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
