"""The surface of DeepSpeed's training engine that this package uses, as a Protocol.

DeepSpeed ships no type information, so ``deepspeed.initialize`` returns an untyped engine; the
modules that take one (the loop, checkpoints, the callbacks) name this instead, and the type
checker holds them to what is written here. It names torch's types for the checker only, so
any module may import it, a torch-free one included.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch
    from torch.optim.lr_scheduler import LRScheduler


class DeepSpeedEngine(Protocol):
    """``deepspeed.DeepSpeedEngine``: the wrapped model, its optimizer and schedule, the step
    counters it checkpoints, and the calls a training step and a checkpoint make."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: LRScheduler | None  # the trainer's schedule is a torch LambdaLR
    global_steps: int
    global_samples: int
    skipped_steps: int
    checkpoint_engine: object  # where save_checkpoint's files go (training/checkpoint_capture.py)
    monitor: object  # DeepSpeed's monitors (training/records/monitor.py)

    training: bool  # it is a torch module: evaluation switches it like one

    def __call__(self, *inputs: object, **kwargs: object) -> torch.Tensor: ...

    def eval(self) -> object: ...

    def train(self, mode: bool = True) -> object: ...

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> object: ...

    def step(self) -> None: ...

    def train_batch_size(self) -> int: ...

    def save_checkpoint(self, save_dir: str, tag: str | None = None) -> bool: ...

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> tuple[str | None, dict[str, object]]: ...
