"""A step that ran out of device memory: where the ranks can retry it in place, and how.

A rank learns that it ran out of memory from ``torch.OutOfMemoryError`` (its type, never its
text), raised in its forward or backward. Its peers learn it at the step's one decision point
(``Callback.before_update``, a host all-reduce before the update). That is safe only where no
collective lies between any backward and that point: then the rank that failed joins the
agreement like the others, and every rank abandons the step together. With ZeRO 0 or 1 and
no expert parallelism the only collective of a step is the boundary's gradient reduction, so the
loop defers it (``deferred_boundary``: every backward runs as a non-boundary one, the reduction
runs after the agreement, ``reduce_at_boundary``): the same reduction of the same gradients, one
call later. ZeRO 2 reduces inside every backward and expert parallelism exchanges rows inside
forward and backward: there the rank that failed cannot reach the agreement, so it stops every
rank (``OutOfMemoryExit``, exit 77) and the next launch resumes at the smaller size.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, cast

import torch

from ds_trhash.errors import UserError
from ds_trhash.training.signals import EXIT_OUT_OF_MEMORY

OTHER_REMEDIES = ("model.activation_checkpointing: true, zero.stage 2 (gradients and optimizer states "
                  "partitioned), parallel.ep_size > 1 (experts split over ranks), or a shorter data.seq_len")


class _Internals(Protocol):
    """What this module asks of DeepSpeed's engine beyond ``engine_api.DeepSpeedEngine`` (its
    accumulation bookkeeping); a test double may lack any of it (``retries_in_place`` is then false)."""

    micro_steps: int
    optimizer: object
    _is_gradient_accumulation_boundary: bool | None

    def zero_optimization_stage(self) -> int: ...

    def zero_optimization_partition_gradients(self) -> bool: ...

    def managed_gradient_accumulation(self) -> bool: ...

    def gradient_accumulation_steps(self) -> int: ...

    def train_batch_size(self) -> int: ...

    def set_train_micro_batch_size(self, micro_batch: int) -> None: ...

    def set_train_batch_size(self, rows: int) -> None: ...

    def set_gradient_accumulation_boundary(self, flag: bool) -> None: ...

    def allreduce_gradients(self) -> None: ...

    def zero_grad(self) -> None: ...


class OutOfMemoryExit(UserError, RuntimeError):
    """A step ran out of device memory where the ranks cannot retry it in place: this rank
    recorded the smaller micro-batch (``record.record_change``) and every rank ends, exit 77;
    ``--resume auto`` continues from the last complete checkpoint at that size."""

    exit_code = EXIT_OUT_OF_MEMORY
    per_rank = True

    def __init__(self, step: int, rank: int, old: int, new: int, grad_accum: int, why: str):
        self.step, self.rank, self.old, self.new, self.grad_accum = step, rank, old, new, grad_accum
        super().__init__(
            f"out of device memory at step {step} (micro-batch {old}); {why}, so the ranks cannot retry the step "
            f"in place: every rank stops, exit {EXIT_OUT_OF_MEMORY}; micro-batch {new} (grad_accum {grad_accum}) "
            "is recorded and --resume auto continues from the last complete checkpoint at that size")


class MicroBatchFloor(UserError, RuntimeError):
    """Out of memory at micro-batch 1: nothing smaller to try (exit 1; checkpoints kept)."""

    exit_code = 1

    def __init__(self, step: int):
        super().__init__(
            f"out of device memory at step {step} with micro-batch 1: no smaller micro-batch is left; the run stops "
            f"(the last complete checkpoint is kept). Reduce memory otherwise: {OTHER_REMEDIES}")


def retries_in_place(engine: object) -> bool:
    """Whether no collective lies between a micro-batch's backward and the step's agreement once
    the boundary's reduction is deferred: a DeepSpeed engine with ZeRO 0 or 1 (no reduction per
    backward, no ``overlap_comm``), no expert-parallel layer, gradient accumulation managed by the
    engine. Anything else (a test double among them) keeps the reduction where DeepSpeed puts it."""
    eng = cast(_Internals, engine)
    try:
        return (eng.zero_optimization_stage() <= 1 and not eng.zero_optimization_partition_gradients()
                and not getattr(eng, "has_moe_layers", False) and eng.managed_gradient_accumulation()
                and not getattr(getattr(eng, "optimizer", None), "overlap_comm", False))
    except AttributeError:
        return False


def why_not_in_place(engine: object) -> str:
    """For the exit line: the collective that lies between the failure and the agreement."""
    if getattr(engine, "has_moe_layers", False):
        return "the expert-parallel all-to-all lies inside forward and backward"
    if getattr(engine, "zero_optimization_partition_gradients", lambda: False)():
        return "ZeRO 2 reduces gradients inside every backward"
    return "the gradient reduction lies inside the backward"


def match_engine(engine: object, micro_steps: int, micro_batch: int) -> None:
    """DeepSpeed's own idea of the step follows the micro-batch in force: ``micro_steps``
    micro-batches of ``micro_batch`` rows, the same global batch (its accumulation boundary, the
    samples it counts). Nothing to do while they agree (and for an engine that has none)."""
    eng = cast(_Internals, engine)
    if not hasattr(eng, "set_train_batch_size") or eng.gradient_accumulation_steps() == micro_steps:
        return
    global_rows = eng.train_batch_size()
    eng.set_train_micro_batch_size(micro_batch)
    eng.set_train_batch_size(global_rows)


@contextlib.contextmanager
def deferred_boundary(engine: object, defer: bool) -> Iterator[None]:
    """Every backward inside runs as a non-boundary one (no reduction); on the way out the engine
    asks its micro-step counter again. Nothing changes when ``defer`` is false."""
    if not defer:
        yield
        return
    eng = cast(_Internals, engine)
    eng.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        eng._is_gradient_accumulation_boundary = None  # DeepSpeed's own "ask the counter" value


def reduce_at_boundary(engine: object) -> None:
    """The deferred boundary: the reduction the boundary backward would have run, now, before the
    update that ``engine.step()`` then applies (as a boundary)."""
    eng = cast(_Internals, engine)
    eng.set_gradient_accumulation_boundary(True)
    eng.allreduce_gradients()


def abandon_step(engine: object, micro_steps: int) -> None:
    """Forget a step's backwards on this rank: gradients (and the optimizer's accumulation buffers)
    freed, the engine's micro-step counter and the ZeRO optimizer's backward bookkeeping as at the
    step's start, the allocator's cache released. Nothing was applied: the weights, the optimizer
    state, the schedule and the data cursor are untouched."""
    eng = cast(_Internals, engine)
    eng.zero_grad()
    optimizer = getattr(eng, "optimizer", None)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        hooks = getattr(optimizer, "_backward_hook_state", None)
        while hooks is not None and getattr(hooks, "backward_active_depth", 0) > 0:  # a backward cut short
            optimizer.exit_backward()
        if hasattr(optimizer, "clear_backward_seen_flag"):
            optimizer.clear_backward_seen_flag()
    eng.micro_steps = micro_steps
    eng._is_gradient_accumulation_boundary = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def raise_out_of_memory(grad: torch.Tensor) -> torch.Tensor:
    """A tensor hook for the fault injection: the error a real allocation failure raises, from
    inside the backward."""
    raise torch.OutOfMemoryError("DS_TRHASH_FAULT: out of memory injected in this backward")
