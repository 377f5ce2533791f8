"""The plan's row order, as arithmetic: no file is read, no state but memos.

* ``segment``    - one pass over one phase in weighted-fair-queuing order (``Segment``, ``SourceRows``);
* ``plan_order`` - the plan's global row order: segments end to end, shuffled in windows by the
  seed (``PlanOrder``; ``ReaderError`` for rows the plan does not hold);
* ``horizon``    - which shards the plan reads over a span of rows, in the order of their first read.

Imports nothing of the stream but ``types``; the reader, the row exchange and the prefetch use it.
"""
from ds_trhash.data.stream.order.horizon import PlanHorizon
from ds_trhash.data.stream.order.plan_order import DEFAULT_SHUFFLE_WINDOW, PlanOrder, ReaderError
from ds_trhash.data.stream.order.segment import RowRef, Segment, SourceRows

__all__ = ["DEFAULT_SHUFFLE_WINDOW", "PlanHorizon", "PlanOrder", "ReaderError", "RowRef", "Segment", "SourceRows"]
