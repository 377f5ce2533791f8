"""One deadline per read: every wait a read makes (the Hub's retries, a download lock another
process holds, room in the cache) ends by the same moment, ``data.hub_wait_minutes`` after the
read began, however many waits it makes.

A read sets it for its thread (``read_deadline``); the waits below it take what is left
(``remaining``). Without one (a prefetch, a single-node read) each wait keeps its own budget.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

_local = threading.local()


@contextlib.contextmanager
def read_deadline(seconds: Optional[float]) -> Iterator[None]:
    """The block's waits on this thread end ``seconds`` from now (None: no deadline; an outer
    deadline that ends sooner is kept)."""
    outer, outer_budget = getattr(_local, "at", None), getattr(_local, "budget", None)
    if seconds is not None:
        at = time.monotonic() + max(0.0, float(seconds))
        if outer is None or at < outer:
            _local.at, _local.budget = at, float(seconds)
    try:
        yield
    finally:
        _local.at, _local.budget = outer, outer_budget


def remaining() -> Optional[float]:
    """Seconds left to this thread's read (None: no deadline), never below 0."""
    at = getattr(_local, "at", None)
    return None if at is None else max(0.0, at - time.monotonic())


def budget() -> Optional[float]:
    """The whole budget of this thread's read, in seconds (None: no deadline)."""
    return getattr(_local, "budget", None)


def capped(budget: float) -> float:
    """``budget``, or what is left of the read's deadline when that is less."""
    left = remaining()
    return budget if left is None else min(budget, left)
