"""The hardware a checkpoint or a run record names: the accelerator, else the CPU model.

Its own module because it asks torch about CUDA devices: the rest of the checkpoint records
(``state``, ``store``) stay importable without torch, so commands that only read checkpoint
files (``ds-trhash sync``, its ``--watch`` passes, ``cleanup``) start in a fraction of a second.
"""
from __future__ import annotations

import contextlib
import platform

import torch


def describe_hardware() -> str:
    """The accelerator of this machine, else its CPU model (for checkpoints and run records)."""
    # a broken CUDA install or an unreadable /proc must not stop a checkpoint or a report
    with contextlib.suppress(RuntimeError):
        if torch.cuda.is_available():
            names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
            return f"{torch.cuda.device_count()} x " + " / ".join(names)
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    return "CPU: " + (platform.processor() or platform.machine() or "unknown model")
