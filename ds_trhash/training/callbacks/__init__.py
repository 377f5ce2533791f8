"""The training loop's parts, one small class per job (see ``base`` for the interface).

``training_parts(evaluation)`` is the order a launch calls them in: the non-finite guard first
(its checks and its ``before_save`` come before anything could save a diverged step), stop
handling (a signal turns into ``stop_requested`` before anything else looks at the step), fault
injection, the evaluation callbacks the entry point supplies (before checkpointing, so an epoch
checkpoint records their results), metrics, the micro-batch in force (after metrics, which
takes the step's expert load before it marks the next step's start), progress, checkpointing, selection (after the
epoch's checkpoint exists), and the profiler last (it starts after a step's other callbacks, so
a trace holds whole steps).
"""
from __future__ import annotations

from collections.abc import Sequence

from ds_trhash.training.callbacks.base import Callback, RunContext, build_callbacks, make_callbacks
from ds_trhash.training.callbacks.checkpointing import CheckpointCallback
from ds_trhash.training.callbacks.faults import FaultCallback, FaultInjection
from ds_trhash.training.callbacks.memory import MicroBatchCallback
from ds_trhash.training.callbacks.metrics import MetricsCallback
from ds_trhash.training.callbacks.nonfinite import NonFiniteGuard
from ds_trhash.training.callbacks.profile import ProfileCallback
from ds_trhash.training.callbacks.progress import ProgressCallback
from ds_trhash.training.callbacks.selection import SelectionCallback
from ds_trhash.training.callbacks.stop import LauncherWatch, StopAgreement, StopCallback, StopRequests


def training_parts(evaluation: Sequence[type[Callback]] = ()) -> list[type[Callback]]:
    """The callback classes of a launch, in call order, with ``evaluation`` slotted in."""
    return [NonFiniteGuard, StopCallback, FaultCallback, *evaluation, MetricsCallback, MicroBatchCallback,
            ProgressCallback, CheckpointCallback, SelectionCallback, ProfileCallback]


__all__ = [
    "Callback", "CheckpointCallback", "FaultCallback", "FaultInjection", "LauncherWatch", "MetricsCallback",
    "MicroBatchCallback", "NonFiniteGuard",
    "ProfileCallback", "ProgressCallback", "RunContext", "SelectionCallback", "StopAgreement", "StopCallback", "StopRequests",
    "build_callbacks", "make_callbacks", "training_parts",
]
