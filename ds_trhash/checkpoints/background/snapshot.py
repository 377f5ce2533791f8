"""A copy in host memory of a state that training goes on changing, for a save written later.

A background save may write a state only once the training thread has moved on; the optimizer
updates weights, master weights and moments in place, so the writer gets a copy taken at the
save's step. The copy keeps what ``torch.save`` would have written: each storage is copied once
(views of one flat buffer stay views of one copy, as DeepSpeed's flattened groups are saved),
with the same offsets, shapes, strides, dtypes, ``requires_grad`` and Parameter types. Device
storages land in pinned host memory (torch's caching host allocator keeps the blocks for the
next save) and the copy is complete when ``host_snapshot`` returns, so nothing of the device
stream is left to order against the next step's in-place updates.

Only the file's device tags differ from a direct save of device tensors: tensors load on the
CPU, which is where every loader of the project and DeepSpeed's own (``map_location`` CPU) put
them anyway.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, cast

import torch

_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), torch.Size, torch.dtype, torch.device)


class _Copier:
    """One snapshot: the storages copied so far, keyed by device and address."""

    def __init__(self) -> None:
        self.storages: dict[tuple[str, int], torch.UntypedStorage] = {}
        self.devices: set[torch.device] = set()
        self.nbytes = 0

    def storage(self, source: torch.UntypedStorage) -> torch.UntypedStorage:
        key = (str(source.device), source.data_ptr())
        host = self.storages.get(key) if source.nbytes() else None
        if host is None:
            src = torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)
            on_device = source.device.type != "cpu"
            dst = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=on_device and torch.cuda.is_available())
            dst.copy_(src, non_blocking=on_device)
            host = dst.untyped_storage()
            if on_device:
                self.devices.add(source.device)
            self.nbytes += source.nbytes()
            if source.nbytes():
                self.storages[key] = host
        return host

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided or t.is_quantized or t.is_meta:
            return t.detach().to("cpu", copy=True)  # not expected in a training state; copied whole
        host = self.storage(t.untyped_storage())
        out = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
        elif t.requires_grad:
            out.requires_grad_(True)
        for name, value in vars(t).items():  # attributes torch.save would pickle with the tensor
            setattr(out, name, self(value))
        return out

    def __call__(self, obj: object) -> object:
        if isinstance(obj, _IMMUTABLE):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
            for key, value in obj.items():
                out[key] = self(value)
            return out
        if isinstance(obj, list):
            return [self(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self(v) for v in obj]
            kind = cast(Callable[..., tuple], type(obj))  # a named tuple takes its fields as arguments
            return kind(*items) if hasattr(obj, "_fields") else kind(items)
        if isinstance(obj, (set, frozenset)):
            return type(obj)(self(v) for v in obj)
        return copy.deepcopy(obj)  # an object (a loss scaler, a config): its state as of now


def host_snapshot(obj: object) -> tuple[object, int]:
    """(copy of ``obj`` in host memory, bytes of tensor data copied). Containers are rebuilt,
    other objects deep-copied; returns once every device copy has completed."""
    copier = _Copier()
    out = copier(obj)
    for device in copier.devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out, copier.nbytes
