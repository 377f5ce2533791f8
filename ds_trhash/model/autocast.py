"""The one question every custom kernel path asks about autocast: which dtype would it run in."""
from __future__ import annotations

import torch


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul on `t`'s device in, None outside autocast.

    Custom ops and kernels that need one dtype for all inputs (routed experts, flex attention)
    cast to it themselves, since autocast only knows the aten ops it has lists for.
    """
    device = t.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None
