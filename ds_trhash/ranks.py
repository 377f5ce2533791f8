"""The ranks of a launch, as every package asks about them: how many run on this node, whether
there are several, and waiting for them all. One definition each, so that the trainer, the data
preparation, the model's self-checks and evaluation cannot disagree on when a collective is due.

DeepSpeed's launcher exports ``LOCAL_SIZE``, torchrun ``LOCAL_WORLD_SIZE``; a plain single
process has neither and is alone on its node unless the world says otherwise. Reading only one
of the two made the node cache's checks use the global world size on several nodes.

A single process, or one without a process group, has nobody to agree with: ``is_multi_rank`` is
false there and ``barrier`` returns at once, so the same code runs alone and under a launcher.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

NODE_RANK_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def ranks_on_node(world: int, env: Mapping[str, str] | None = None) -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` or ``LOCAL_SIZE``, else ``world`` (one node)."""
    env = os.environ if env is None else env
    for name in NODE_RANK_VARIABLES:
        value = env.get(name)
        if value:
            return int(value)
    return world


def is_multi_rank() -> bool:
    """Whether a process group of more than one rank is running: only then is a collective due
    (every rank must then make the same calls in the same order)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    if is_multi_rank():
        dist.barrier()


_HOST_GROUP: dist.ProcessGroup | None = None


def _host_group() -> dist.ProcessGroup | None:
    """A gloo group for host integers: reducing them on the CPU keeps the accelerator stream free
    of host synchronisation (NCCL would need a device tensor and a copy back). On a gloo default
    group (CPU runs) it is that group."""
    global _HOST_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _HOST_GROUP is None:
        _HOST_GROUP = dist.new_group(backend="gloo")
    return _HOST_GROUP


def host_all_reduce(values: list[int], op: str = "sum") -> list[int]:
    """``values`` summed (or their "max", "min") over every rank, on the host (gloo, CPU tensors):
    no device involved. A single process gets its own values back."""
    if not is_multi_rank():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                    group=_host_group())
    return [int(v) for v in t]
